"""A small Llama-style decoder: its numpy forward, its training on text, and its two ONNX forms.

The architecture is Llama's at toy size: byte tokens (vocabulary 256), RMSNorm, rotary position
embeddings, grouped-query attention (fewer key/value heads than query heads), a SwiGLU feed-forward
network and an untied output projection. Two exports of the same weights:

* :func:`plain_model` - standard ONNX ops, laid out as ``torch.onnx`` / optimum export a Llama:
  inputs ``input_ids``, ``attention_mask``, ``position_ids`` and ``past_key_values.{i}.key/value``
  ([batch, kv_heads, past, head_dim]); outputs ``logits`` and ``present.{i}.key/value``. Positions
  index constant cos/sin tables (Gather), the causal mask is built from shapes (Shape, Gather,
  Range, Trilu), and the key/value heads are repeated with Expand/Reshape.
* :func:`contrib_model` - the form onnxruntime's transformer optimizer and its model builder write:
  ``SimplifiedLayerNormalization``, ``SkipSimplifiedLayerNormalization`` and ``GroupQueryAttention``
  (rotary inside, ``seqlens_k`` and ``total_sequence_length`` from the attention mask); no
  ``position_ids`` input.

Training (:func:`train`) uses ``autograd`` (the ``samples`` extra) on the Python standard library's
own sources (code, comments and docstrings; :func:`corpus`), every tenth module held out: the
evaluation token files come from modules the training never saw.
``generate.py`` calls this module; the generated files are committed.
"""

from __future__ import annotations

import ast
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class DecoderShape:
    """The decoder's sizes."""

    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    max_positions: int = 1024
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# ------------------------------------------------------------------ weights
def init_weights(shape: DecoderShape, seed: int, scale: float = 0.02) -> dict[str, np.ndarray]:
    """Llama-like initial weights ([in, out] for every projection, as exported MatMul weights)."""
    rng = np.random.default_rng(seed)
    kv = shape.kv_heads * shape.head_dim
    out_scale = scale / math.sqrt(2 * shape.layers)

    def normal(*dims: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal(dims) * std).astype(np.float32)

    w: dict[str, np.ndarray] = {"embed": normal(shape.vocab, shape.hidden, std=1.0 / math.sqrt(shape.hidden))}
    for i in range(shape.layers):
        w |= {
            f"l{i}.attn_norm": np.ones(shape.hidden, np.float32),
            f"l{i}.q": normal(shape.hidden, shape.hidden),
            f"l{i}.k": normal(shape.hidden, kv),
            f"l{i}.v": normal(shape.hidden, kv),
            f"l{i}.o": normal(shape.hidden, shape.hidden, std=out_scale),
            f"l{i}.ffn_norm": np.ones(shape.hidden, np.float32),
            f"l{i}.gate": normal(shape.hidden, shape.ffn),
            f"l{i}.up": normal(shape.hidden, shape.ffn),
            f"l{i}.down": normal(shape.ffn, shape.hidden, std=out_scale),
        }
    w["final_norm"] = np.ones(shape.hidden, np.float32)
    w["lm_head"] = normal(shape.hidden, shape.vocab)
    return w


def rotary_tables(shape: DecoderShape) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, [max_positions, head_dim / 2] (the half that rotate_half pairs up)."""
    half = shape.head_dim // 2
    inv = 1.0 / shape.rope_theta ** (np.arange(half, dtype=np.float64) / half)
    angles = np.arange(shape.max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# ------------------------------------------------------------------ numpy forward (training)
def forward(xp: Any, w: dict[str, Any], ids: np.ndarray, shape: DecoderShape) -> Any:
    """Logits [batch, seq, vocab] of a prefill (no cache); ``xp`` is numpy or autograd.numpy."""
    batch, seq = ids.shape
    hd, heads, kvh = shape.head_dim, shape.heads, shape.kv_heads
    cos, sin = rotary_tables(shape)
    cos = np.concatenate([cos[:seq], cos[:seq]], axis=-1)
    sin = np.concatenate([sin[:seq], sin[:seq]], axis=-1)
    causal = np.triu(np.full((seq, seq), -1e9, np.float32), k=1)

    def norm(x: Any, g: Any) -> Any:
        return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + shape.eps) * g

    def rope(x: Any) -> Any:
        rotated = xp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * cos + rotated * sin

    x = w["embed"][ids]
    for i in range(shape.layers):
        h = norm(x, w[f"l{i}.attn_norm"])
        q = xp.transpose(xp.reshape(h @ w[f"l{i}.q"], (batch, seq, heads, hd)), (0, 2, 1, 3))
        k = xp.transpose(xp.reshape(h @ w[f"l{i}.k"], (batch, seq, kvh, hd)), (0, 2, 1, 3))
        v = xp.transpose(xp.reshape(h @ w[f"l{i}.v"], (batch, seq, kvh, hd)), (0, 2, 1, 3))
        q, k = rope(q), rope(k)
        k, v = xp.repeat(k, heads // kvh, axis=1), xp.repeat(v, heads // kvh, axis=1)
        scores = q @ xp.transpose(k, (0, 1, 3, 2)) / math.sqrt(hd) + causal
        scores = scores - xp.max(scores, axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs = probs / xp.sum(probs, axis=-1, keepdims=True)
        attended = xp.reshape(xp.transpose(probs @ v, (0, 2, 1, 3)), (batch, seq, heads * hd))
        x = x + attended @ w[f"l{i}.o"]
        h = norm(x, w[f"l{i}.ffn_norm"])
        gate = h @ w[f"l{i}.gate"]
        x = x + (gate / (1 + xp.exp(-gate)) * (h @ w[f"l{i}.up"])) @ w[f"l{i}.down"]
    return norm(x, w["final_norm"]) @ w["lm_head"]


def cross_entropy(xp: Any, logits: Any, targets: np.ndarray) -> Any:
    """Mean next-token cross entropy (nats)."""
    top = xp.max(logits, axis=-1, keepdims=True)
    logz = xp.log(xp.sum(xp.exp(logits - top), axis=-1)) + top[..., 0]
    vocab = logits.shape[-1]
    picked = xp.sum(logits * np.eye(vocab, dtype=np.float32)[targets], axis=-1)
    return xp.mean(logz - picked)


# ------------------------------------------------------------------ text
def corpus(limit_bytes: int = 3_000_000, *, source: bool = True) -> tuple[bytes, bytes]:
    """(training text, held-out text): printable-ASCII Python of the standard library.

    ``source``: whole modules (code, comments and docstrings as written); else their docstrings only.
    Modules are taken in sorted path order; every tenth module is held out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = bytearray(), bytearray()
    skip = ("test", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    for index, path in enumerate(files):
        try:
            code = path.read_text(encoding="utf-8")
            tree = ast.parse(code)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [code] if source else []
        for node in ast.walk(tree):
            if not source and isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
        text = "\n\n".join(docs).encode("ascii", "ignore")
        text = bytes(c for c in text if c == 10 or 32 <= c < 127)
        (held if index % 10 == 9 else train).extend(text + b"\n\n")
        if len(train) >= limit_bytes:
            break
    return bytes(train), bytes(held)


def windows(text: bytes, length: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random windows of ``length`` bytes, as int64 tokens."""
    data = np.frombuffer(text, dtype=np.uint8)
    starts = rng.integers(0, len(data) - length - 1, size=count)
    return np.stack([data[s : s + length] for s in starts]).astype(np.int64)


# ------------------------------------------------------------------ training
def train(
    shape: DecoderShape, text: bytes, *, steps: int, batch: int, length: int, seed: int, log: Any = print
) -> dict[str, np.ndarray]:
    """Adam with warm-up and cosine decay on next-byte prediction; returns float32 weights."""
    import autograd.numpy as anp
    from autograd import value_and_grad

    rng = np.random.default_rng(seed)
    weights = init_weights(shape, seed)

    def loss(w: dict[str, Any], ids: np.ndarray) -> Any:
        return cross_entropy(anp, forward(anp, w, ids[:, :-1], shape), ids[:, 1:])

    step_fn = value_and_grad(loss)
    m = {k: np.zeros_like(v) for k, v in weights.items()}
    s = {k: np.zeros_like(v) for k, v in weights.items()}
    peak, warmup, b1, b2 = 3e-3, max(1, steps // 20), 0.9, 0.99
    for step in range(1, steps + 1):
        ids = windows(text, length + 1, batch, rng)
        value, grads = step_fn(weights, ids)
        lr = peak * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        clip = min(1.0, 1.0 / (norm + 1e-12))
        for k, g in grads.items():
            g = g * clip
            m[k] = b1 * m[k] + (1 - b1) * g
            s[k] = b2 * s[k] + (1 - b2) * g * g
            update = (m[k] / (1 - b1**step)) / (np.sqrt(s[k] / (1 - b2**step)) + 1e-8)
            decay = 0.0 if k.endswith("norm") else 0.01
            weights[k] = (weights[k] - lr * (update + decay * weights[k])).astype(np.float32)
        if step % 100 == 0 or step == 1:
            log(f"step {step}/{steps}: loss {float(value):.3f} nats/byte")
    return weights


# ------------------------------------------------------------------ ONNX: shared pieces
class _Graph:
    """Nodes and initializers under construction, with fresh names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self._count = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        self._count += 1
        name = f"/{op_type}_{self._count}"
        outputs = [f"{name}_out{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name


def _io(shape: DecoderShape, contrib: bool) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    hd, kvh = shape.head_dim, shape.kv_heads
    ints = ["input_ids", "attention_mask"] + ([] if contrib else ["position_ids"])
    dims = {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "total_sequence"]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, dims.get(n, ["batch", "sequence"])) for n in ints]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", shape.vocab])]
    for i in range(shape.layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, ["batch", kvh, "past_sequence", hd]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, ["batch", kvh, "total_sequence", hd])
            )
    return inputs, outputs


def _finish(g: _Graph, shape: DecoderShape, contrib: bool, name: str) -> onnx.ModelProto:
    inputs, outputs = _io(shape, contrib)
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    model.producer_name = "qtool-sample-models"
    model.producer_version = "1"
    return model


def _int64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ------------------------------------------------------------------ ONNX: plain ops
def plain_model(w: dict[str, np.ndarray], shape: DecoderShape) -> onnx.ModelProto:
    """The decoder in standard ONNX ops (opset 17), with a key/value cache."""
    g = _Graph()
    hd, heads, kvh = shape.head_dim, shape.heads, shape.kv_heads
    cos, sin = rotary_tables(shape)
    g.const("rotary.cos", np.concatenate([cos, cos], axis=-1))
    g.const("rotary.sin", np.concatenate([sin, sin], axis=-1))
    for const, value in {
        "c.eps": np.array(shape.eps, np.float32),
        "c.two": np.array(2.0, np.float32),
        "c.scale": np.array(1 / math.sqrt(hd), np.float32),
        "c.min": np.array(np.finfo(np.float32).min, np.float32),
        "c.one_i": _int64(1),
        "c.two_i": _int64(2),
        "c.axis0": _int64(0),
        "c.axis1": _int64(1),
        "c.half": _int64(hd // 2),
        "c.end": _int64(hd),
        "c.axes12": _int64(1, 2),
        "c.q_shape": _int64(0, 0, heads, hd),
        "c.kv_shape": _int64(0, 0, kvh, hd),
        "c.merge": _int64(0, 0, heads * hd),
    }.items():
        g.const(const, value)
    x = g.op("Gather", [g.const("model.embed_tokens.weight", w["embed"]), "input_ids"])
    # shape arithmetic: the causal mask over (new tokens) x (past + new tokens), and the padding mask
    past_shape = g.op("Shape", ["past_key_values.0.key"])
    past_len = g.op("Gather", [past_shape, "c.two_i"], axis=0)
    seq_len = g.op("Gather", [g.op("Shape", ["input_ids"]), "c.one_i"], axis=0)
    total = g.op("Add", [past_len, seq_len])
    square = g.op("ConstantOfShape", [g.op("Concat", [seq_len, total], axis=0)], value=helper.make_tensor("", TensorProto.INT64, [1], [1]))
    causal = g.op("Trilu", [square, g.op("Squeeze", [past_len, "c.axis0"])], upper=0)
    padding = g.op("Unsqueeze", ["attention_mask", "c.axes12"])
    allowed = g.op("Cast", [g.op("Mul", [causal, padding])], to=TensorProto.BOOL)
    cos_pos = g.op("Unsqueeze", [g.op("Gather", ["rotary.cos", "position_ids"]), "c.axis1"])
    sin_pos = g.op("Unsqueeze", [g.op("Gather", ["rotary.sin", "position_ids"]), "c.axis1"])

    def rms(x: str, weight: str) -> str:
        var = g.op("ReduceMean", [g.op("Pow", [x, "c.two"])], axes=[-1], keepdims=1)
        return g.op("Mul", [g.op("Mul", [x, g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, "c.eps"])])])]), weight])

    def heads_first(x: str, shape_const: str) -> str:
        return g.op("Transpose", [g.op("Reshape", [x, shape_const])], perm=[0, 2, 1, 3])

    def rope_apply(x: str) -> str:
        first = g.op("Slice", [x, "c.axis0", "c.half", "c.minus1_axis"])
        second = g.op("Slice", [x, "c.half", "c.end", "c.minus1_axis"])
        rotated = g.op("Concat", [g.op("Neg", [second]), first], axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos_pos]), g.op("Mul", [rotated, sin_pos])])

    g.const("c.minus1_axis", _int64(-1))
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        h = rms(x, g.const(f"{p}.input_layernorm.weight", w[f"l{i}.attn_norm"]))
        q = heads_first(g.op("MatMul", [h, g.const(f"{p}.self_attn.q_proj.weight", w[f"l{i}.q"])]), "c.q_shape")
        k = heads_first(g.op("MatMul", [h, g.const(f"{p}.self_attn.k_proj.weight", w[f"l{i}.k"])]), "c.kv_shape")
        v = heads_first(g.op("MatMul", [h, g.const(f"{p}.self_attn.v_proj.weight", w[f"l{i}.v"])]), "c.kv_shape")
        q, k = rope_apply(q), rope_apply(k)
        g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.key", k], [f"present.{i}.key"], name=f"/{p}/present_key", axis=2))
        g.nodes.append(helper.make_node("Concat", [f"past_key_values.{i}.value", v], [f"present.{i}.value"], name=f"/{p}/present_value", axis=2))
        k_all, v_all = _repeat_kv(g, f"present.{i}.key", shape), _repeat_kv(g, f"present.{i}.value", shape)
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])]), "c.scale"])
        probs = g.op("Softmax", [g.op("Where", [allowed, scores, "c.min"])], axis=-1)
        merged = g.op("Reshape", [g.op("Transpose", [g.op("MatMul", [probs, v_all])], perm=[0, 2, 1, 3]), "c.merge"])
        x = g.op("Add", [x, g.op("MatMul", [merged, g.const(f"{p}.self_attn.o_proj.weight", w[f"l{i}.o"])])])
        h = rms(x, g.const(f"{p}.post_attention_layernorm.weight", w[f"l{i}.ffn_norm"]))
        gate = g.op("MatMul", [h, g.const(f"{p}.mlp.gate_proj.weight", w[f"l{i}.gate"])])
        up = g.op("MatMul", [h, g.const(f"{p}.mlp.up_proj.weight", w[f"l{i}.up"])])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        x = g.op("Add", [x, g.op("MatMul", [act, g.const(f"{p}.mlp.down_proj.weight", w[f"l{i}.down"])])])
    h = rms(x, g.const("model.norm.weight", w["final_norm"]))
    g.nodes.append(helper.make_node("MatMul", [h, g.const("lm_head.weight", w["lm_head"])], ["logits"], name="/lm_head/MatMul"))
    return _finish(g, shape, False, "llama_style_decoder")


def _repeat_kv(g: _Graph, x: str, shape: DecoderShape) -> str:
    """[b, kv, t, d] -> [b, heads, t, d], each key/value head shared by heads / kv_heads query heads."""
    rep = shape.heads // shape.kv_heads
    dims = g.op("Shape", [x])
    b = g.op("Slice", [dims, "c.axis0", "c.one_i"])
    t = g.op("Slice", [dims, "c.two_i", g.const(f"c.three_{x}", _int64(3))])
    expanded_shape = g.op(
        "Concat", [b, g.const(f"c.kvrep_{x}", _int64(shape.kv_heads, rep)), t, g.const(f"c.hd_{x}", _int64(shape.head_dim))], axis=0
    )
    expanded = g.op("Expand", [g.op("Unsqueeze", [x, g.const(f"c.ax2_{x}", _int64(2))]), expanded_shape])
    merged_shape = g.op("Concat", [b, g.const(f"c.heads_{x}", _int64(shape.heads)), t, g.const(f"c.hd2_{x}", _int64(shape.head_dim))], axis=0)
    return g.op("Reshape", [expanded, merged_shape])


# ------------------------------------------------------------------ ONNX: onnxruntime contrib ops
def contrib_model(w: dict[str, np.ndarray], shape: DecoderShape) -> onnx.ModelProto:
    """The decoder as onnxruntime's model builder writes it: GroupQueryAttention, Simplified norms."""
    g = _Graph()
    cos, sin = rotary_tables(shape)
    g.const("cos_cache", cos)
    g.const("sin_cache", sin)
    g.const("c.one", _int64(1))
    g.const("c.one_s", np.array(1, np.int64))
    g.const("c.axis1", _int64(1))
    mask_sum = g.op("ReduceSum", ["attention_mask", "c.axis1"], keepdims=0)
    seqlens = g.op("Cast", [g.op("Sub", [mask_sum, "c.one"])], to=TensorProto.INT32)
    total = g.op("Cast", [g.op("Gather", [g.op("Shape", ["attention_mask"]), "c.one_s"], axis=0)], to=TensorProto.INT32)
    x = g.op("Gather", [g.const("model.embed_tokens.weight", w["embed"]), "input_ids"])
    first = w["l0.attn_norm"]
    h = g.op("SimplifiedLayerNormalization", [x, g.const("model.layers.0.input_layernorm.weight", first)], axis=-1, epsilon=shape.eps)
    residual = x
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        q = g.op("MatMul", [h, g.const(f"{p}.self_attn.q_proj.weight", w[f"l{i}.q"])])
        k = g.op("MatMul", [h, g.const(f"{p}.self_attn.k_proj.weight", w[f"l{i}.k"])])
        v = g.op("MatMul", [h, g.const(f"{p}.self_attn.v_proj.weight", w[f"l{i}.v"])])
        attn = f"/{p}/attn/GroupQueryAttention"
        g.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total, "cos_cache", "sin_cache"],
                [f"{attn}_out", f"present.{i}.key", f"present.{i}.value"],
                name=attn,
                domain="com.microsoft",
                num_heads=shape.heads,
                kv_num_heads=shape.kv_heads,
                do_rotary=1,
                rotary_interleaved=0,
            )
        )
        o = g.op("MatMul", [f"{attn}_out", g.const(f"{p}.self_attn.o_proj.weight", w[f"l{i}.o"])])
        h, _, _, residual = g.op(
            "SkipSimplifiedLayerNormalization",
            [o, residual, g.const(f"{p}.post_attention_layernorm.weight", w[f"l{i}.ffn_norm"])],
            n_out=4,
            domain="com.microsoft",
            epsilon=shape.eps,
        )
        gate = g.op("MatMul", [h, g.const(f"{p}.mlp.gate_proj.weight", w[f"l{i}.gate"])])
        up = g.op("MatMul", [h, g.const(f"{p}.mlp.up_proj.weight", w[f"l{i}.up"])])
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        down = g.op("MatMul", [act, g.const(f"{p}.mlp.down_proj.weight", w[f"l{i}.down"])])
        norm = w[f"l{i + 1}.attn_norm"] if i + 1 < shape.layers else w["final_norm"]
        norm_name = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < shape.layers else "model.norm.weight"
        h, _, _, residual = g.op(
            "SkipSimplifiedLayerNormalization", [down, residual, g.const(norm_name, norm)], n_out=4, domain="com.microsoft", epsilon=shape.eps
        )
    g.nodes.append(helper.make_node("MatMul", [h, g.const("lm_head.weight", w["lm_head"])], ["logits"], name="/lm_head/MatMul"))
    return _finish(g, shape, True, "llama_style_decoder_gqa")


# ------------------------------------------------------------------ the committed sample
def token_files(directory: Path, sequences: np.ndarray) -> None:
    """One ``.npz`` per sequence holding ``input_ids`` [1, length]; qtool fills the cache inputs."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.npz"):
        old.unlink()
    for i, ids in enumerate(sequences):
        np.savez(directory / f"tokens_{i:04d}.npz", input_ids=ids[None].astype(np.int64))


# ------------------------------------------------------------------ large generated decoders (external data)
def weight_shapes(shape: DecoderShape) -> dict[str, tuple[int, ...]]:
    """The decoder's weights by :func:`sample_models.decoder.init_weights` name, [in, out] like it."""
    kv = shape.kv_heads * shape.head_dim
    dims: dict[str, tuple[int, ...]] = {"embed": (shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        dims |= {
            f"l{i}.attn_norm": (shape.hidden,),
            f"l{i}.q": (shape.hidden, shape.hidden),
            f"l{i}.k": (shape.hidden, kv),
            f"l{i}.v": (shape.hidden, kv),
            f"l{i}.o": (shape.hidden, shape.hidden),
            f"l{i}.ffn_norm": (shape.hidden,),
            f"l{i}.gate": (shape.hidden, shape.ffn),
            f"l{i}.up": (shape.hidden, shape.ffn),
            f"l{i}.down": (shape.ffn, shape.hidden),
        }
    return dims | {"final_norm": (shape.hidden,), "lm_head": (shape.hidden, shape.vocab)}


def external_plain_model(folder: Path, shape: DecoderShape, *, seed: int = 0, scale: float = 0.02) -> tuple[Path, int]:
    """:func:`plain_model` with seeded random weights in ``model.onnx`` + ``model.onnx.data``: (path, weight bytes).

    For models of any size (the 2 GiB protobuf limit never applies): the graph is built with 1-element
    placeholders; each weight is then drawn, appended to the data file and its initializer pointed at
    it, so memory never holds more than one weight.
    """
    rng = np.random.default_rng(seed)
    dims = weight_shapes(shape)
    model = plain_model({name: np.zeros(1, np.float32) for name in dims}, shape)
    by_value = {id_: name for name, id_ in _initializer_names(shape).items()}
    data_name = "model.onnx.data"
    written = 0
    with open(folder / data_name, "wb") as data:
        for tensor in model.graph.initializer:
            name = by_value.get(tensor.name)
            if name is None:
                continue
            values = _draw(rng, name, dims[name], shape, scale)
            offset = data.tell()
            values.tofile(data)
            written += values.nbytes
            del tensor.dims[:]
            tensor.dims.extend(values.shape)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(values.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx", written


def _initializer_names(shape: DecoderShape) -> dict[str, str]:
    """init_weights name -> the initializer name plain_model gives it."""
    names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        names |= {
            f"l{i}.attn_norm": f"{p}.input_layernorm.weight",
            f"l{i}.q": f"{p}.self_attn.q_proj.weight",
            f"l{i}.k": f"{p}.self_attn.k_proj.weight",
            f"l{i}.v": f"{p}.self_attn.v_proj.weight",
            f"l{i}.o": f"{p}.self_attn.o_proj.weight",
            f"l{i}.ffn_norm": f"{p}.post_attention_layernorm.weight",
            f"l{i}.gate": f"{p}.mlp.gate_proj.weight",
            f"l{i}.up": f"{p}.mlp.up_proj.weight",
            f"l{i}.down": f"{p}.mlp.down_proj.weight",
        }
    return names


def _draw(rng: np.random.Generator, name: str, dims: tuple[int, ...], shape: DecoderShape, scale: float) -> np.ndarray:
    """Seeded float32 values: norms near 1, the embedding at 1/sqrt(hidden), the rest at ``scale``."""
    if name.endswith("norm"):
        return (1 + 0.1 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    std = 1 / math.sqrt(shape.hidden) if name == "embed" else scale
    values = rng.standard_normal(dims, dtype=np.float32)
    values *= np.float32(std)
    return values


TRAIN_LENGTH = 96  # tokens per training window: the positions the model has learnt
PROMPT_LENGTH = 64  # tokens per calibration and evaluation file: a prompt and 16 decode steps stay within them


def build(out: Path, *, steps: int = 1600, n_calib: int = 32, n_eval: int = 64, log: Any = print) -> None:
    """Train the sample decoder and write both forms and its token files under ``out``.

    The token files are prompts of :data:`PROMPT_LENGTH` tokens, so a prompt and the 16 greedy steps
    that continue it stay within the positions training saw (a tiny model does not extrapolate: past
    them its greedy continuation turns to noise, near-ties everywhere).
    """
    shape = DecoderShape()
    text, held = corpus()
    weights = train(shape, text, steps=steps, batch=24, length=TRAIN_LENGTH, seed=2030, log=log)
    out.mkdir(parents=True, exist_ok=True)
    plain = plain_model(weights, shape)
    onnx.checker.check_model(plain, full_check=True)
    onnx.save(plain, out / "model.onnx")
    onnx.save(contrib_model(weights, shape), out / "model_gqa.onnx")
    rng = np.random.default_rng(2031)
    token_files(out / "calib", windows(text, PROMPT_LENGTH, n_calib, rng))
    token_files(out / "eval", windows(held, PROMPT_LENGTH, n_eval, rng))
