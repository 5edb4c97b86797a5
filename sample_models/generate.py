"""Build the bundled sample models and their calibration / evaluation data.

Run ``python sample_models/generate.py`` to regenerate everything below
``sample_models/``. The script is seeded, so the output is reproducible on the
same numpy version; the generated files are committed so that users and tests
never need to run it.

Each model is small but realistic:

* ``cnn``  - Conv + BatchNormalization + Relu + MaxPool blocks, GlobalAveragePool
  and a Gemm classifier over synthetic "texture" images (10 classes of oriented
  colour gratings). BatchNormalization statistics are measured on the data, and
  the classifier head is trained for a few hundred steps of softmax regression.
* ``mlp``  - MatMul + Add + Relu layers trained with Adam for a few hundred steps
  on a non-linearly separable synthetic classification task.
* ``transformer`` - one pre-LayerNorm encoder block (multi-head self-attention
  with MatMul / Softmax, and an Erf-GELU feed-forward network) whose weights are
  scaled like trained BERT-style layers, over embedding-like token sequences.
* ``encoder`` - a two-layer BERT-style sentence encoder with int64 ``input_ids`` and
  ``attention_mask``: word/position/type embeddings (Gather), post-LayerNorm with a
  few outlier dimensions, BERT's additive attention mask, one layer written as
  tf2onnx writes it (Einsum) and one as torch.onnx does (MatMul, a transposed weight,
  a Gemm), and a masked mean-pooled sentence embedding (``pooled``). Its samples are
  ``.npz`` files of Zipf-distributed token sequences of varying length.

Calibration (``calib/``) and evaluation (``eval/``) sets are disjoint draws, one
sample per ``.npy`` file without the batch dimension (``.npz`` with a batch of one
for the multi-input encoder).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent
N_CALIB = 64
N_EVAL = 32


# --------------------------------------------------------------------- helpers
def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _write_data(directory: Path, samples: np.ndarray) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for i, sample in enumerate(samples):
        np.save(directory / f"sample_{i:04d}.npy", sample.astype(np.float32))


def _save(model: onnx.ModelProto, name: str, data: np.ndarray) -> None:
    model.producer_name = "qtool-sample-models"
    model.producer_version = "1"
    onnx.checker.check_model(model, full_check=True)
    out = ROOT / name
    out.mkdir(exist_ok=True)
    onnx.save(model, out / "model.onnx")
    _write_data(out / "calib", data[:N_CALIB])
    _write_data(out / "eval", data[N_CALIB : N_CALIB + N_EVAL])


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------------- CNN
def _texture_images(rng: np.random.Generator, n: int, size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Oriented colour gratings with noise; the label is the orientation bucket."""
    labels = rng.integers(0, 10, size=n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    images = np.empty((n, 3, size, size), dtype=np.float32)
    for i, label in enumerate(labels):
        angle = np.pi * (label + rng.uniform(-0.3, 0.3)) / 10
        freq = rng.uniform(3.0, 7.0)
        phase = rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy) + phase)
        colour = rng.uniform(0.2, 1.0, size=3).astype(np.float32)
        img = colour[:, None, None] * (0.5 + 0.4 * wave)[None] + rng.normal(0, 0.08, (3, size, size))
        images[i] = (np.clip(img, 0, 1) - 0.45) / 0.25  # ImageNet-like normalisation
    return images, labels


def _conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """3x3 stride-1 pad-1 convolution in numpy (im2col)."""
    n, c, h, wd = x.shape
    m = w.shape[0]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.stack([xp[:, :, i : i + h, j : j + wd] for i in range(3) for j in range(3)], axis=2)
    cols = cols.reshape(n, c * 9, h * wd)
    out = np.einsum("mk,nkp->nmp", w.reshape(m, c * 9), cols, optimize=True)
    return out.reshape(n, m, h, wd) + b[None, :, None, None]


def _maxpool2(x: np.ndarray) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def build_cnn(rng: np.random.Generator) -> None:
    channels = [3, 32, 64, 128]
    n_train = 512
    images, labels = _texture_images(rng, n_train + N_CALIB + N_EVAL)
    train_x, train_y = images[:n_train], labels[:n_train]

    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    x = train_x
    prev = "input"
    for layer, (cin, cout) in enumerate(zip(channels[:-1], channels[1:])):
        # Kaiming-scaled filters with a per-channel gain spread, as trained layers show.
        gain = rng.lognormal(0.0, 0.35, size=(cout, 1, 1, 1)).astype(np.float32)
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9)) * gain).astype(np.float32)
        b = rng.normal(0, 0.05, cout).astype(np.float32)
        y = _conv2d(x, w, b)
        # BatchNorm statistics measured on the data, like a trained network's running stats.
        mean = y.mean(axis=(0, 2, 3)).astype(np.float32)
        var = y.var(axis=(0, 2, 3)).astype(np.float32)
        gamma = rng.normal(1.0, 0.15, cout).astype(np.float32)
        beta = rng.normal(0.1, 0.1, cout).astype(np.float32)
        y = gamma[None, :, None, None] * (y - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
        y = np.maximum(y + beta[None, :, None, None], 0)
        p = f"block{layer}"
        inits += [
            _init(f"{p}.conv.weight", w),
            _init(f"{p}.conv.bias", b),
            _init(f"{p}.bn.scale", gamma),
            _init(f"{p}.bn.bias", beta),
            _init(f"{p}.bn.mean", mean),
            _init(f"{p}.bn.var", var),
        ]
        nodes += [
            helper.make_node("Conv", [prev, f"{p}.conv.weight", f"{p}.conv.bias"], [f"{p}/conv_out"],
                             name=f"{p}/conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization",
                             [f"{p}/conv_out", f"{p}.bn.scale", f"{p}.bn.bias", f"{p}.bn.mean", f"{p}.bn.var"],
                             [f"{p}/bn_out"], name=f"{p}/bn", epsilon=1e-5),
            helper.make_node("Relu", [f"{p}/bn_out"], [f"{p}/relu_out"], name=f"{p}/relu"),
        ]
        prev = f"{p}/relu_out"
        if layer < len(channels) - 2:
            nodes.append(helper.make_node("MaxPool", [prev], [f"{p}/pool_out"], name=f"{p}/pool",
                                          kernel_shape=[2, 2], strides=[2, 2]))
            prev = f"{p}/pool_out"
            y = _maxpool2(y)
        x = y

    features = x.mean(axis=(2, 3))
    # Softmax-regression head trained with gradient descent on the pooled features.
    fw = np.zeros((10, channels[-1]), dtype=np.float32)
    fb = np.zeros(10, dtype=np.float32)
    onehot = np.eye(10, dtype=np.float32)[train_y]
    f_mean, f_std = features.mean(0), features.std(0) + 1e-6
    fn = (features - f_mean) / f_std
    for _ in range(300):
        p_ = _softmax(fn @ fw.T + fb)
        grad = (p_ - onehot) / n_train
        fw -= 0.5 * (grad.T @ fn + 1e-3 * fw)
        fb -= 0.5 * grad.sum(0)
    # Fold the feature standardisation into the Gemm weights.
    gemm_w = (fw / f_std[None, :]).astype(np.float32)
    gemm_b = (fb - (fw * (f_mean / f_std)[None, :]).sum(1)).astype(np.float32)
    accuracy = float(((fn @ fw.T + fb).argmax(1) == train_y).mean())
    print(f"cnn: head train accuracy {accuracy:.2f}")

    inits += [_init("head.weight", gemm_w), _init("head.bias", gemm_b)]
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap_out"], name="gap"),
        helper.make_node("Flatten", ["gap_out"], ["flat_out"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat_out", "head.weight", "head.bias"], ["logits"], name="head/gemm", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "sample_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    _save(model, "cnn", images[n_train:])


# ------------------------------------------------------------------------- MLP
def build_mlp(rng: np.random.Generator) -> None:
    dims = [64, 256, 256, 10]
    n_train = 2048
    n = n_train + N_CALIB + N_EVAL
    centers = rng.normal(0, 1, (10, 16))
    labels = rng.integers(0, 10, n)
    latent = centers[labels] + rng.normal(0, 0.6, (n, 16))
    mix = rng.normal(0, 1, (16, 64)) / 4
    x = (np.tanh(latent @ mix) * 2 + rng.normal(0, 0.1, (n, 64))).astype(np.float32)
    train_x, train_y = x[:n_train], labels[:n_train]

    weights = [rng.normal(0, np.sqrt(2.0 / a), (a, b)) for a, b in zip(dims[:-1], dims[1:])]
    biases = [np.zeros(b) for b in dims[1:]]
    params = weights + biases
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    onehot = np.eye(10)[train_y]
    for step in range(1, 401):
        batch = rng.integers(0, n_train, 128)
        acts = [train_x[batch]]
        for i, (w, b) in enumerate(zip(weights, biases)):
            z = acts[-1] @ w + b
            acts.append(np.maximum(z, 0) if i < len(weights) - 1 else z)
        grad_z = (_softmax(acts[-1]) - onehot[batch]) / len(batch)
        grads_w, grads_b = [], []
        for i in reversed(range(len(weights))):
            grads_w.insert(0, acts[i].T @ grad_z + 1e-4 * weights[i])
            grads_b.insert(0, grad_z.sum(0))
            if i:
                grad_z = (grad_z @ weights[i].T) * (acts[i] > 0)
        for j, (p, g) in enumerate(zip(params, grads_w + grads_b)):
            m[j] = 0.9 * m[j] + 0.1 * g
            v[j] = 0.999 * v[j] + 0.001 * g * g
            p -= 2e-3 * (m[j] / (1 - 0.9**step)) / (np.sqrt(v[j] / (1 - 0.999**step)) + 1e-8)
    h = train_x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = h @ w + b
        h = np.maximum(h, 0) if i < len(weights) - 1 else h
    print(f"mlp: train accuracy {float((h.argmax(1) == train_y).mean()):.2f}")

    nodes, inits = [], []
    prev = "input"
    for i, (w, b) in enumerate(zip(weights, biases)):
        p = f"fc{i}"
        inits += [_init(f"{p}.weight", w.astype(np.float32)), _init(f"{p}.bias", b.astype(np.float32))]
        last = i == len(weights) - 1
        nodes += [
            helper.make_node("MatMul", [prev, f"{p}.weight"], [f"{p}/matmul_out"], name=f"{p}/matmul"),
            helper.make_node("Add", [f"{p}/matmul_out", f"{p}.bias"], ["logits" if last else f"{p}/add_out"],
                             name=f"{p}/add"),
        ]
        if not last:
            nodes.append(helper.make_node("Relu", [f"{p}/add_out"], [f"{p}/relu_out"], name=f"{p}/relu"))
            prev = f"{p}/relu_out"
    graph = helper.make_graph(
        nodes, "sample_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    _save(model, "mlp", x[n_train:])


# ----------------------------------------------------------------- transformer
def build_transformer(rng: np.random.Generator) -> None:
    seq, d, heads, ff = 16, 64, 4, 256
    dh = d // heads
    n = N_CALIB + N_EVAL
    vocab = rng.normal(0, 1.0, (500, d))
    pos = np.array([[np.sin(p / 10000 ** (2 * (i // 2) / d)) if i % 2 == 0 else np.cos(p / 10000 ** (2 * (i // 2) / d))
                     for i in range(d)] for p in range(seq)])
    tokens = rng.integers(0, 500, (n, seq))
    x = (vocab[tokens] + 0.5 * pos[None]).astype(np.float32)

    def dense(a: int, b: int) -> np.ndarray:
        # BERT-like scale with heavier-tailed rows, as trained projections show.
        w = rng.standard_t(df=6, size=(a, b)) * 0.6 / np.sqrt(a)
        return w.astype(np.float32)

    def vec(scale: float, centre: float = 0.0, size: int = d) -> np.ndarray:
        return (centre + rng.normal(0, scale, size)).astype(np.float32)

    inits = [
        _init("ln1.scale", vec(0.1, 1.0)), _init("ln1.bias", vec(0.05)),
        _init("attn.q.weight", dense(d, d)), _init("attn.q.bias", vec(0.02)),
        _init("attn.k.weight", dense(d, d)), _init("attn.k.bias", vec(0.02)),
        _init("attn.v.weight", dense(d, d)), _init("attn.v.bias", vec(0.02)),
        _init("attn.out.weight", dense(d, d)), _init("attn.out.bias", vec(0.02)),
        _init("ln2.scale", vec(0.1, 1.0)), _init("ln2.bias", vec(0.05)),
        _init("ffn.up.weight", dense(d, ff)), _init("ffn.up.bias", vec(0.02, size=ff)),
        _init("ffn.down.weight", dense(ff, d)), _init("ffn.down.bias", vec(0.02)),
        _init("heads_shape", np.array([0, seq, heads, dh], dtype=np.int64)),
        _init("merge_shape", np.array([0, seq, d], dtype=np.int64)),
        _init("attn_scale", np.array(1.0 / np.sqrt(dh), dtype=np.float32)),
        _init("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32)),
        _init("one", np.array(1.0, dtype=np.float32)),
        _init("half", np.array(0.5, dtype=np.float32)),
    ]
    mk = helper.make_node
    nodes = [mk("LayerNormalization", ["input", "ln1.scale", "ln1.bias"], ["ln1_out"], name="ln1", axis=-1,
                epsilon=1e-5)]
    for proj in ("q", "k", "v"):
        nodes += [
            mk("MatMul", ["ln1_out", f"attn.{proj}.weight"], [f"{proj}_mm"], name=f"attn/{proj}/matmul"),
            mk("Add", [f"{proj}_mm", f"attn.{proj}.bias"], [f"{proj}_proj"], name=f"attn/{proj}/add"),
            mk("Reshape", [f"{proj}_proj", "heads_shape"], [f"{proj}_heads"], name=f"attn/{proj}/reshape"),
        ]
    nodes += [
        mk("Transpose", ["q_heads"], ["q_t"], name="attn/q/transpose", perm=[0, 2, 1, 3]),
        mk("Transpose", ["k_heads"], ["k_t"], name="attn/k/transpose", perm=[0, 2, 3, 1]),
        mk("Transpose", ["v_heads"], ["v_t"], name="attn/v/transpose", perm=[0, 2, 1, 3]),
        mk("MatMul", ["q_t", "k_t"], ["scores"], name="attn/scores/matmul"),
        mk("Mul", ["scores", "attn_scale"], ["scores_scaled"], name="attn/scores/scale"),
        mk("Softmax", ["scores_scaled"], ["probs"], name="attn/softmax", axis=-1),
        mk("MatMul", ["probs", "v_t"], ["context"], name="attn/context/matmul"),
        mk("Transpose", ["context"], ["context_t"], name="attn/context/transpose", perm=[0, 2, 1, 3]),
        mk("Reshape", ["context_t", "merge_shape"], ["context_merged"], name="attn/context/reshape"),
        mk("MatMul", ["context_merged", "attn.out.weight"], ["attn_mm"], name="attn/out/matmul"),
        mk("Add", ["attn_mm", "attn.out.bias"], ["attn_out"], name="attn/out/add"),
        mk("Add", ["input", "attn_out"], ["resid1"], name="resid1"),
        mk("LayerNormalization", ["resid1", "ln2.scale", "ln2.bias"], ["ln2_out"], name="ln2", axis=-1,
           epsilon=1e-5),
        mk("MatMul", ["ln2_out", "ffn.up.weight"], ["up_mm"], name="ffn/up/matmul"),
        mk("Add", ["up_mm", "ffn.up.bias"], ["up_out"], name="ffn/up/add"),
        # GELU(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
        mk("Div", ["up_out", "sqrt2"], ["gelu_div"], name="ffn/gelu/div"),
        mk("Erf", ["gelu_div"], ["gelu_erf"], name="ffn/gelu/erf"),
        mk("Add", ["gelu_erf", "one"], ["gelu_add"], name="ffn/gelu/add"),
        mk("Mul", ["up_out", "gelu_add"], ["gelu_mul"], name="ffn/gelu/mul"),
        mk("Mul", ["gelu_mul", "half"], ["gelu_out"], name="ffn/gelu/half"),
        mk("MatMul", ["gelu_out", "ffn.down.weight"], ["down_mm"], name="ffn/down/matmul"),
        mk("Add", ["down_mm", "ffn.down.bias"], ["ffn_out"], name="ffn/down/add"),
        mk("Add", ["resid1", "ffn_out"], ["output"], name="resid2"),
    ]
    graph = helper.make_graph(
        nodes, "sample_transformer_block",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", seq, d])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", seq, d])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    _save(model, "transformer", x)


# --------------------------------------------------------------------- encoder
def _write_feeds(directory: Path, feeds: list[dict[str, np.ndarray]]) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for i, feed in enumerate(feeds):
        np.savez(directory / f"sample_{i:04d}.npz", **feed)


def build_encoder(rng: np.random.Generator) -> None:
    """A two-layer BERT-style sentence encoder with int64 token inputs, written as exporters write them."""
    vocab, seq, d, heads, ff = 3000, 32, 64, 4, 256
    dh = d // heads
    mk = helper.make_node

    def dense(a: int, b: int) -> np.ndarray:
        return (rng.standard_t(df=6, size=(a, b)) * 0.6 / np.sqrt(a)).astype(np.float32)

    def vec(scale: float, centre: float = 0.0, size: int = d) -> np.ndarray:
        return (centre + rng.normal(0, scale, size)).astype(np.float32)

    def gamma() -> np.ndarray:
        g = vec(0.1, 1.0)
        g[[7, 41]] = [5.0, -4.0]  # the few outlier dimensions trained BERT LayerNorms have
        return g

    inits = [
        _init("embeddings.word", (rng.normal(0, 0.05, (vocab, d)) * (1 + 3 * (np.arange(vocab) < 50))[:, None])
              .astype(np.float32)),
        _init("embeddings.position", rng.normal(0, 0.02, (seq, d)).astype(np.float32)),
        _init("embeddings.type", rng.normal(0, 0.02, (2, d)).astype(np.float32)),
        _init("position_ids", np.arange(seq, dtype=np.int64)),
        _init("type_ids", np.zeros(seq, dtype=np.int64)),
        _init("embeddings.ln.scale", gamma()), _init("embeddings.ln.bias", vec(0.05)),
        _init("one", np.array(1.0, np.float32)), _init("neg_big", np.array(-10000.0, np.float32)),
        _init("sqrt2", np.array(np.sqrt(2.0), np.float32)), _init("half", np.array(0.5, np.float32)),
        _init("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32)),
        _init("mask_axes", np.array([1, 2], np.int64)), _init("last_axis", np.array([-1], np.int64)),
        _init("seq_axis", np.array([1], np.int64)),
        _init("heads_shape", np.array([0, seq, heads, dh], np.int64)),
        _init("tokens_shape", np.array([-1, seq, d], np.int64)),
        _init("flat_shape", np.array([-1, d], np.int64)),
    ]
    nodes = [
        mk("Gather", ["embeddings.word", "input_ids"], ["word_emb"], name="embeddings/word"),
        mk("Gather", ["embeddings.position", "position_ids"], ["pos_emb"], name="embeddings/position"),
        mk("Gather", ["embeddings.type", "type_ids"], ["type_emb"], name="embeddings/type"),
        mk("Add", ["word_emb", "pos_emb"], ["emb_sum1"], name="embeddings/add_position"),
        mk("Add", ["emb_sum1", "type_emb"], ["emb_sum"], name="embeddings/add_type"),
        mk("LayerNormalization", ["emb_sum", "embeddings.ln.scale", "embeddings.ln.bias"], ["hidden0"],
           name="embeddings/ln", axis=-1, epsilon=1e-12),
        # BERT's additive mask: (1 - mask) * -10000, broadcast over heads and query positions.
        mk("Cast", ["attention_mask"], ["mask_f"], name="mask/cast", to=TensorProto.FLOAT),
        mk("Sub", ["one", "mask_f"], ["mask_inv"], name="mask/invert"),
        mk("Mul", ["mask_inv", "neg_big"], ["mask_add"], name="mask/scale"),
        mk("Unsqueeze", ["mask_add", "mask_axes"], ["mask_bias"], name="mask/unsqueeze"),  # [b, 1, 1, s]
    ]

    def ffn(layer: int, x: str) -> list[onnx.NodeProto]:
        p = f"layer{layer}"
        inits.extend([
            _init(f"{p}.ffn.up.weight", dense(d, ff)), _init(f"{p}.ffn.up.bias", vec(0.02, size=ff)),
            _init(f"{p}.ffn.down.weight", dense(ff, d)), _init(f"{p}.ffn.down.bias", vec(0.02)),
            _init(f"{p}.ln2.scale", gamma()), _init(f"{p}.ln2.bias", vec(0.05)),
        ])
        return [
            mk("MatMul", [x, f"{p}.ffn.up.weight"], [f"{p}/up_mm"], name=f"{p}/ffn/up/matmul"),
            mk("Add", [f"{p}/up_mm", f"{p}.ffn.up.bias"], [f"{p}/up"], name=f"{p}/ffn/up/add"),
            mk("Div", [f"{p}/up", "sqrt2"], [f"{p}/gelu_div"], name=f"{p}/ffn/gelu/div"),
            mk("Erf", [f"{p}/gelu_div"], [f"{p}/gelu_erf"], name=f"{p}/ffn/gelu/erf"),
            mk("Add", [f"{p}/gelu_erf", "one"], [f"{p}/gelu_add"], name=f"{p}/ffn/gelu/add"),
            mk("Mul", [f"{p}/up", f"{p}/gelu_add"], [f"{p}/gelu_mul"], name=f"{p}/ffn/gelu/mul"),
            mk("Mul", [f"{p}/gelu_mul", "half"], [f"{p}/gelu"], name=f"{p}/ffn/gelu/half"),
            mk("MatMul", [f"{p}/gelu", f"{p}.ffn.down.weight"], [f"{p}/down_mm"], name=f"{p}/ffn/down/matmul"),
            mk("Add", [f"{p}/down_mm", f"{p}.ffn.down.bias"], [f"{p}/down"], name=f"{p}/ffn/down/add"),
            mk("Add", [x, f"{p}/down"], [f"{p}/ffn_res"], name=f"{p}/ffn/residual"),
            mk("LayerNormalization", [f"{p}/ffn_res", f"{p}.ln2.scale", f"{p}.ln2.bias"], [f"hidden{layer + 1}"],
               name=f"{p}/ln2", axis=-1, epsilon=1e-12),
        ]

    # Layer 0 as tf2onnx writes it: Einsum projections with [d, heads, dh] weights, Einsum attention.
    p = "layer0"
    for proj in ("q", "k", "v"):
        inits += [_init(f"{p}.{proj}.weight", dense(d, d).reshape(d, heads, dh)),
                  _init(f"{p}.{proj}.bias", vec(0.02).reshape(heads, dh))]
        nodes += [
            mk("Einsum", ["hidden0", f"{p}.{proj}.weight"], [f"{p}/{proj}_e"], name=f"{p}/attn/{proj}/einsum",
               equation="bsd,dhk->bshk"),
            mk("Add", [f"{p}/{proj}_e", f"{p}.{proj}.bias"], [f"{p}/{proj}"], name=f"{p}/attn/{proj}/add"),
        ]
    inits += [_init(f"{p}.out.weight", dense(d, d).reshape(heads, dh, d)), _init(f"{p}.out.bias", vec(0.02)),
              _init(f"{p}.ln1.scale", gamma()), _init(f"{p}.ln1.bias", vec(0.05))]
    nodes += [
        mk("Einsum", [f"{p}/q", f"{p}/k"], [f"{p}/scores"], name=f"{p}/attn/scores/einsum", equation="bqhk,bshk->bhqs"),
        mk("Mul", [f"{p}/scores", "attn_scale"], [f"{p}/scores_scaled"], name=f"{p}/attn/scores/scale"),
        mk("Add", [f"{p}/scores_scaled", "mask_bias"], [f"{p}/scores_masked"], name=f"{p}/attn/scores/mask"),
        mk("Softmax", [f"{p}/scores_masked"], [f"{p}/probs"], name=f"{p}/attn/softmax", axis=-1),
        mk("Einsum", [f"{p}/probs", f"{p}/v"], [f"{p}/context"], name=f"{p}/attn/context/einsum",
           equation="bhqs,bshk->bqhk"),
        mk("Einsum", [f"{p}/context", f"{p}.out.weight"], [f"{p}/attn_e"], name=f"{p}/attn/out/einsum",
           equation="bqhk,hkd->bqd"),
        mk("Add", [f"{p}/attn_e", f"{p}.out.bias"], [f"{p}/attn"], name=f"{p}/attn/out/add"),
        mk("Add", ["hidden0", f"{p}/attn"], [f"{p}/attn_res"], name=f"{p}/attn/residual"),
        mk("LayerNormalization", [f"{p}/attn_res", f"{p}.ln1.scale", f"{p}.ln1.bias"], [f"{p}/attn_ln"],
           name=f"{p}/ln1", axis=-1, epsilon=1e-12),
    ]
    nodes += ffn(0, f"{p}/attn_ln")

    # Layer 1 as torch.onnx writes it: MatMul + Add, Reshape/Transpose to heads, batched MatMul; the
    # key weight stored [out, in] behind a Transpose, the output projection a Gemm on flattened tokens.
    p = "layer1"
    for proj in ("q", "k", "v"):
        weight = dense(d, d)
        stored = f"{p}.{proj}.weight" + (".t" if proj == "k" else "")
        inits += [_init(stored, weight.T.copy() if proj == "k" else weight), _init(f"{p}.{proj}.bias", vec(0.02))]
        read = stored
        if proj == "k":
            nodes.append(mk("Transpose", [stored], [f"{p}/k_weight"], name=f"{p}/attn/k/weight_t", perm=[1, 0]))
            read = f"{p}/k_weight"
        nodes += [
            mk("MatMul", ["hidden1", read], [f"{p}/{proj}_mm"], name=f"{p}/attn/{proj}/matmul"),
            mk("Add", [f"{p}/{proj}_mm", f"{p}.{proj}.bias"], [f"{p}/{proj}_b"], name=f"{p}/attn/{proj}/add"),
            mk("Reshape", [f"{p}/{proj}_b", "heads_shape"], [f"{p}/{proj}_h"], name=f"{p}/attn/{proj}/reshape"),
        ]
    inits += [_init(f"{p}.out.weight", dense(d, d).T.copy()), _init(f"{p}.out.bias", vec(0.02)),
              _init(f"{p}.ln1.scale", gamma()), _init(f"{p}.ln1.bias", vec(0.05))]
    nodes += [
        mk("Transpose", [f"{p}/q_h"], [f"{p}/q_t"], name=f"{p}/attn/q/transpose", perm=[0, 2, 1, 3]),
        mk("Transpose", [f"{p}/k_h"], [f"{p}/k_t"], name=f"{p}/attn/k/transpose", perm=[0, 2, 3, 1]),
        mk("Transpose", [f"{p}/v_h"], [f"{p}/v_t"], name=f"{p}/attn/v/transpose", perm=[0, 2, 1, 3]),
        mk("MatMul", [f"{p}/q_t", f"{p}/k_t"], [f"{p}/scores"], name=f"{p}/attn/scores/matmul"),
        mk("Mul", [f"{p}/scores", "attn_scale"], [f"{p}/scores_scaled"], name=f"{p}/attn/scores/scale"),
        mk("Add", [f"{p}/scores_scaled", "mask_bias"], [f"{p}/scores_masked"], name=f"{p}/attn/scores/mask"),
        mk("Softmax", [f"{p}/scores_masked"], [f"{p}/probs"], name=f"{p}/attn/softmax", axis=-1),
        mk("MatMul", [f"{p}/probs", f"{p}/v_t"], [f"{p}/context"], name=f"{p}/attn/context/matmul"),
        mk("Transpose", [f"{p}/context"], [f"{p}/context_t"], name=f"{p}/attn/context/transpose", perm=[0, 2, 1, 3]),
        mk("Reshape", [f"{p}/context_t", "flat_shape"], [f"{p}/context_flat"], name=f"{p}/attn/context/flatten"),
        mk("Gemm", [f"{p}/context_flat", f"{p}.out.weight", f"{p}.out.bias"], [f"{p}/attn_flat"],
           name=f"{p}/attn/out/gemm", transB=1),
        mk("Reshape", [f"{p}/attn_flat", "tokens_shape"], [f"{p}/attn"], name=f"{p}/attn/out/reshape"),
        mk("Add", ["hidden1", f"{p}/attn"], [f"{p}/attn_res"], name=f"{p}/attn/residual"),
        mk("LayerNormalization", [f"{p}/attn_res", f"{p}.ln1.scale", f"{p}.ln1.bias"], [f"{p}/attn_ln"],
           name=f"{p}/ln1", axis=-1, epsilon=1e-12),
    ]
    nodes += ffn(1, f"{p}/attn_ln")
    # The sentence embedding: the mean of the hidden states over the real (unmasked) tokens.
    nodes += [
        mk("Identity", ["hidden2"], ["last_hidden_state"], name="output/hidden"),
        mk("Unsqueeze", ["mask_f", "last_axis"], ["mask_col"], name="pool/mask"),
        mk("Mul", ["hidden2", "mask_col"], ["masked_hidden"], name="pool/apply_mask"),
        mk("ReduceSum", ["masked_hidden", "seq_axis"], ["hidden_sum"], name="pool/sum", keepdims=0),
        mk("ReduceSum", ["mask_col", "seq_axis"], ["token_count"], name="pool/count", keepdims=0),
        mk("Div", ["hidden_sum", "token_count"], ["pooled"], name="pool/mean"),
    ]
    graph = helper.make_graph(
        nodes, "sample_bert_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", seq, d]),
         helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", d])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model.producer_name, model.producer_version = "qtool-sample-models", "1"
    onnx.checker.check_model(model, full_check=True)
    # Sentences: Zipf-distributed token ids (as text is), [CLS]=1 ... [SEP]=2, padded with 0.
    feeds = []
    for _ in range(N_CALIB + N_EVAL):
        length = int(rng.integers(8, seq + 1))
        ids = np.zeros(seq, np.int64)
        ids[:length] = np.minimum(rng.zipf(1.3, length) + 2, vocab - 1)
        ids[0], ids[length - 1] = 1, 2
        mask = (np.arange(seq) < length).astype(np.int64)
        feeds.append({"input_ids": ids[None], "attention_mask": mask[None]})
    out = ROOT / "encoder"
    out.mkdir(exist_ok=True)
    onnx.save(model, out / "model.onnx")
    _write_feeds(out / "calib", feeds[:N_CALIB])
    _write_feeds(out / "eval", feeds[N_CALIB:])


def main() -> None:
    build_cnn(np.random.default_rng(2026))
    build_mlp(np.random.default_rng(2027))
    build_transformer(np.random.default_rng(2028))
    build_encoder(np.random.default_rng(2029))
    from decoder import build as build_decoder  # needs the `samples` extra (autograd)

    build_decoder(ROOT / "decoder")


if __name__ == "__main__":
    main()
