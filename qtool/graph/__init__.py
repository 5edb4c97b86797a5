"""The model as files and arrays: load and save, preparation, detached weights, onnxruntime sessions, opsets."""
