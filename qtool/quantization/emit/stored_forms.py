"""How a quantized tensor is written into the graph: initializers plus the nodes that restore it.

Three forms of a weight (Q/DQ for integer kernels, Cast/Mul restored at load for storage placement,
float16 with a Cast) and the scale/zero-point initializers and DequantizeLinear nodes they share.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.index import all_nodes
from qtool.graph.names import fresh_name
from qtool.numerics.matmul_nbits import make_matmul_nbits, pack_codes
from qtool.numerics.qparams import QParams, quant_type, to_tensor_proto
from qtool.schemes import TensorScheme


class Names:
    """Hands out tensor/node names that do not clash with the graph's."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.taken = {i.name for i in graph.initializer} | {i.name for i in graph.input}
        for node in all_nodes(graph):  # a body may not reuse an outer name, so its names are taken too
            self.taken.update(node.input)
            self.taken.update(node.output)
            self.taken.add(node.name)

    def new(self, base: str) -> str:
        return fresh_name(base, self.taken)


class StoredForms:
    """Writes quantized tensors into ``graph`` and their restoring nodes into ``prologue``."""

    def __init__(self, names: Names, graph: onnx.GraphProto, prologue: list[onnx.NodeProto]) -> None:
        self.names = names
        self.graph = graph
        self.prologue = prologue
        self.dynamic_inputs: dict[str, tuple[str, ...]] = {}  # input -> its DynamicQuantizeLinear's outputs
        self.contrib_ops = False  # whether a com.microsoft op (MatMulNBits) was written

    def add_qparam_inits(self, base: str, qp: QParams) -> tuple[str, str]:
        scale = self.names.new(f"{base}/scale")
        zero = self.names.new(f"{base}/zero_point")
        self.graph.initializer.append(numpy_helper.from_array(qp.scale.astype(np.float32), scale))
        self.graph.initializer.append(numpy_helper.from_array(qp.zero_point, zero))
        return scale, zero

    def dq_node(
        self, base: str, source: str, scale: str, zero: str, output: str, axis: int | None, block: int | None = None
    ) -> onnx.NodeProto:
        inputs = [source, scale, zero] if zero else [source, scale]
        node = helper.make_node("DequantizeLinear", inputs, [output], name=self.names.new(f"{base}/DequantizeLinear"))
        if axis is not None:
            node.attribute.append(helper.make_attribute("axis", axis))
        if block is not None:
            node.attribute.append(helper.make_attribute("block_size", block))
        return node

    def integers(self, name: str, values: np.ndarray, qp: QParams) -> str:
        """Store quantized ``values`` (4- and 2-bit packed) as an initializer; returns its name.

        One stored tensor may feed several of the forms below (see :mod:`qtool.quantization.emit.weight_copies`).
        """
        stored = self.names.new(f"{name}/quantized")
        self.graph.initializer.append(to_tensor_proto(values, qp.qtype, stored))
        return stored

    def dequantized(self, name: str, stored: str, qp: QParams, output: str, *, zero_point: bool = True) -> None:
        """Make a DequantizeLinear turn the integers ``stored`` into ``output``.

        A 4- or 2-bit weight with per-tensor/per-channel scales is first widened by
        a Cast to its 8-bit type: onnxruntime folds that Cast at load and then runs
        the node in its int8 kernels (it has none for narrower weights, and would
        otherwise fuse them anyway and reject the model). Block-wise weights keep
        a narrow DequantizeLinear, which onnxruntime turns into MatMulNBits.
        ``zero_point=False`` leaves out a zero point that is all zeros (the operator's
        default): a symmetric per-block weight would otherwise store one per block.
        """
        zero_type = qp.qtype
        if qp.qtype.bits < 8 and qp.block_size is None:
            zero_type = quant_type("int8" if qp.qtype.signed else "uint8")
            widened = self.names.new(f"{name}/widened")
            self.prologue.append(
                helper.make_node(
                    "Cast", [stored], [widened], name=self.names.new(f"{name}/Cast"), to=zero_type.onnx_type
                )
            )
            stored = widened
        scale = self.names.new(f"{name}/scale")
        self.graph.initializer.append(numpy_helper.from_array(qp.scale.astype(np.float32), scale))
        zero = ""
        if zero_point or np.any(qp.zero_point != 0):
            zero = self.names.new(f"{name}/zero_point")
            self.graph.initializer.append(to_tensor_proto(qp.zero_point, zero_type, zero))
        self.prologue.append(self.dq_node(name, stored, scale, zero, output, qp.axis, qp.block_size))

    def restored_at_load(self, name: str, stored: str, qp: QParams, output: str, shape: tuple[int, ...]) -> None:
        """Restore float ``output`` from the integers ``stored`` (of ``shape``) with Cast/Sub/Mul on constants.

        onnxruntime folds them at load: the file keeps the quantized size, and inference runs the
        float kernel with no Quantize/DequantizeLinear cost (placement "storage").
        """
        source = stored
        if qp.qtype.bits < 8:  # widen first: Cast from 4/2-bit to float is not foldable everywhere
            widened = self.names.new(f"{name}/widened")
            wide = TensorProto.INT8 if qp.qtype.signed else TensorProto.UINT8
            self.prologue.append(
                helper.make_node("Cast", [source], [widened], name=self.names.new(f"{name}/Widen"), to=wide)
            )
            source = widened
        as_float = self.names.new(f"{name}/as_float")
        self.prologue.append(
            helper.make_node("Cast", [source], [as_float], name=self.names.new(f"{name}/Cast"), to=TensorProto.FLOAT)
        )
        if np.any(qp.zero_point != 0):
            zero_type = np.int8 if qp.qtype.signed else np.uint8  # stored as 8-bit integers, made float at load
            zero_name = self._factor(name, "zero_point", qp.zero_point.astype(zero_type), qp, shape)
            centred = self.names.new(f"{name}/centred")
            self.prologue.append(
                helper.make_node("Sub", [as_float, zero_name], [centred], name=self.names.new(f"{name}/Sub"))
            )
            as_float = centred
        scale_name = self._factor(name, "scale", qp.scale.astype(np.float32), qp, shape)
        self.prologue.append(
            helper.make_node("Mul", [as_float, scale_name], [output], name=self.names.new(f"{name}/Mul"))
        )

    def _factor(self, name: str, part: str, values: np.ndarray, qp: QParams, shape: tuple[int, ...]) -> str:
        """``values`` (a scale or zero point of ``qp``) as a tensor that broadcasts against ``shape``.

        Per tensor and per channel they are stored as they are. Per block they are stored one per
        block and repeated along the block axis by Unsqueeze/Expand/Reshape(/Slice) on constants,
        which onnxruntime folds at load: a stored copy of every value's scale would be as large as
        the float weight.
        """
        stored = self.names.new(f"{name}/{part}")
        if qp.axis is None or qp.block_size is None:
            length = shape[qp.axis] if qp.axis is not None else 0
            expanded = qp.expand(values.astype(np.float32), len(shape), length)
            self.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(expanded), stored))
            return stored
        self.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(values), stored))
        axis, blocks = qp.axis, values.shape[qp.axis]
        grown = [*values.shape[: axis + 1], qp.block_size, *values.shape[axis + 1 :]]
        flat = [*values.shape[:axis], blocks * qp.block_size, *values.shape[axis + 1 :]]
        consts = {
            "axes": np.array([axis + 1], np.int64),
            "grown": np.array(grown, np.int64),
            "flat": np.array(flat, np.int64),
        }
        names = {}
        for key, const in consts.items():
            names[key] = self.names.new(f"{name}/{part}_{key}")
            self.graph.initializer.append(numpy_helper.from_array(const, names[key]))
        current = stored
        for op, operand in (("Unsqueeze", names["axes"]), ("Expand", names["grown"]), ("Reshape", names["flat"])):
            produced = self.names.new(f"{name}/{part}_{op.lower()}")
            node_name = self.names.new(f"{name}/{part}_{op}")
            self.prologue.append(helper.make_node(op, [current, operand], [produced], name=node_name))
            current = produced
        if blocks * qp.block_size != shape[axis]:  # the last block is partial: cut the repeat to the length
            bounds = [np.array([v], np.int64) for v in (0, shape[axis], axis)]
            bound_names = []
            for key, const in zip(("start", "end", "axis"), bounds, strict=True):
                bound_names.append(self.names.new(f"{name}/{part}_{key}"))
                self.graph.initializer.append(numpy_helper.from_array(const, bound_names[-1]))
            sliced = self.names.new(f"{name}/{part}_slice")
            self.prologue.append(
                helper.make_node(
                    "Slice", [current, *bound_names], [sliced], name=self.names.new(f"{name}/{part}_Slice")
                )
            )
            current = sliced
        if values.dtype != np.float32:
            as_float = self.names.new(f"{name}/{part}_float")
            cast = helper.make_node("Cast", [current], [as_float], name=self.names.new(f"{name}/{part}_Cast"), to=1)
            self.prologue.append(cast)
            current = as_float
        return current

    def dynamic_matmul(self, node: onnx.NodeProto, qp: QParams | None, trans_b: bool) -> list[onnx.NodeProto]:
        """The nodes that compute MatMul/Gemm ``node`` with its input quantized at run time.

        ``node`` reads its stored integer weight (quantized with ``qp``) as input 1; without ``qp``
        input 1 is an activation, quantized at run time too (MatMulInteger, unfused). The pattern is
        onnxruntime's own ``quantize_dynamic`` form, which its optimizer fuses (bias Add included) into
        one DynamicQuantizeMatMul: DynamicQuantizeLinear(x) -> MatMulInteger -> Cast -> Mul by the
        product of the input's and the weight's scales. A narrow or transposed weight is widened and
        transposed by nodes on constants, folded at load.
        """
        base = node.name
        x, codes, out = node.input[0], node.input[1], node.output[0]
        built: list[onnx.NodeProto] = []
        if qp is None:
            weight = self._run_time_quantized(codes, base, built)
            product = self._integer_product(base, self._run_time_quantized(x, base, built), weight, out, None)
            return [*built, *product]
        wide = quant_type("int8" if qp.qtype.signed else "uint8")
        if qp.qtype.bits < 8:
            widened = self.names.new(f"{codes}/widened")
            self.prologue.append(
                helper.make_node("Cast", [codes], [widened], name=self.names.new(f"{base}/Widen"), to=wide.onnx_type)
            )
            codes = widened
        if trans_b:
            upright = self.names.new(f"{codes}/transposed")
            self.prologue.append(
                helper.make_node("Transpose", [codes], [upright], name=self.names.new(f"{base}/Transpose"), perm=[1, 0])
            )
            codes = upright
        zeros = qp.zero_point.reshape(-1)
        one_zero = zeros.size == 1 or bool(np.all(zeros == zeros[0]))
        scale = self.names.new(f"{base}/weight_scale")
        zero = self.names.new(f"{base}/weight_zero_point")
        self.graph.initializer.append(numpy_helper.from_array(qp.scale.astype(np.float32).reshape(-1), scale))
        self.graph.initializer.append(to_tensor_proto(zeros[:1].reshape(()) if one_zero else zeros, wide, zero))
        quantized_x = self._run_time_quantized(x, base, built)
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] != "" else None
        return [*built, *self._integer_product(base, quantized_x, (codes, scale, zero), out, bias)]

    def _run_time_quantized(self, tensor: str, base: str, built: list[onnx.NodeProto]) -> tuple[str, str, str]:
        """The uint8 values, scale and zero point of ``tensor`` quantized at run time.

        A tensor several dynamic nodes read is quantized once, by the first of them in graph order
        (its DynamicQuantizeLinear joins ``built``).
        """
        if tensor not in self.dynamic_inputs:
            parts = ("quantized", "scale", "zero_point")
            self.dynamic_inputs[tensor] = tuple(self.names.new(f"{tensor}/{part}") for part in parts)
            name = self.names.new(f"{base}/DynamicQuantize")
            built.append(
                helper.make_node("DynamicQuantizeLinear", [tensor], list(self.dynamic_inputs[tensor]), name=name)
            )
        q, s, z = self.dynamic_inputs[tensor]
        return q, s, z

    def _integer_product(
        self, base: str, a: tuple[str, str, str], b: tuple[str, str, str], out: str, bias: str | None
    ) -> list[onnx.NodeProto]:
        """MatMulInteger -> Cast -> Mul by both scales (-> bias Add) writing ``out``.

        ``a`` and ``b``: each operand's integers, scale and zero point (tensor names).
        """
        (aq, a_scale, a_zero), (bq, b_scale, b_zero) = a, b
        scales, product, as_float = (self.names.new(f"{base}/{part}") for part in ("scales", "integers", "as_float"))
        scaled = self.names.new(f"{base}/scaled") if bias else out
        cast = helper.make_node(
            "Cast", [product], [as_float], name=self.names.new(f"{base}/Cast"), to=TensorProto.FLOAT
        )
        built = [
            helper.make_node("Mul", [a_scale, b_scale], [scales], name=self.names.new(f"{base}/ScaleMul")),
            helper.make_node(
                "MatMulInteger", [aq, bq, a_zero, b_zero], [product], name=self.names.new(f"{base}/MatMulInteger")
            ),
            cast,
            helper.make_node("Mul", [as_float, scales], [scaled], name=self.names.new(f"{base}/Rescale")),
        ]
        if bias:
            built.append(helper.make_node("Add", [scaled, bias], [out], name=self.names.new(f"{base}/BiasAdd")))
        return built

    def gathered(self, node: onnx.NodeProto, qp: QParams, rank: int) -> list[onnx.NodeProto]:
        """The nodes that compute lookup ``node`` on its stored integer table, dequantizing the rows it reads.

        ``node`` (a Gather along axis 0 of a table of ``rank``) reads the integers as input 0, so the
        table stays 8-bit in memory (a 4- or 2-bit table is widened to 8 bits at load): Gather -> Cast
        -> (Sub the rows' zero points) -> Mul by the rows' scales, gathered with the same indices.
        """
        base = node.name
        table, indices, out = node.input[0], node.input[1], node.output[0]
        if qp.qtype.bits < 8:
            wide = quant_type("int8" if qp.qtype.signed else "uint8")
            widened = self.names.new(f"{table}/widened")
            self.prologue.append(
                helper.make_node("Cast", [table], [widened], name=self.names.new(f"{base}/Widen"), to=wide.onnx_type)
            )
            table = widened
        rows = self.names.new(f"{base}/rows")
        as_float = self.names.new(f"{base}/rows_float")
        lookup = helper.make_node("Gather", [table, indices], [rows], name=base, axis=0)
        built = [lookup, helper.make_node("Cast", [rows], [as_float], name=self.names.new(f"{base}/Cast"), to=1)]

        def per_row(values: np.ndarray, part: str) -> str:
            """``values`` (one per row, or one for all) as the factor for the rows read."""
            name = self.names.new(f"{base}/{part}")
            if qp.axis is None:
                self.graph.initializer.append(numpy_helper.from_array(values.astype(np.float32).reshape(()), name))
                return name
            column = values.astype(np.float32).reshape([-1] + [1] * (rank - 1))
            self.graph.initializer.append(numpy_helper.from_array(column, name))
            picked = self.names.new(f"{base}/{part}_rows")
            built.append(helper.make_node("Gather", [name, indices], [picked], name=self.names.new(f"{name}/Gather")))
            return picked

        if np.any(qp.zero_point != 0):
            centred = self.names.new(f"{base}/rows_centred")
            zero = per_row(qp.zero_point, "zero_point")
            built.append(helper.make_node("Sub", [as_float, zero], [centred], name=self.names.new(f"{base}/Sub")))
            as_float = centred
        scale = per_row(qp.scale, "scale")
        built.append(helper.make_node("Mul", [as_float, scale], [out], name=self.names.new(f"{base}/Mul")))
        return built

    def matmul_nbits(
        self, node: onnx.NodeProto, codes: np.ndarray, qp: QParams, spec: TensorScheme, trans_b: bool
    ) -> list[onnx.NodeProto]:
        """MatMulNBits (onnxruntime's; and a Gemm's bias Add) computing ``node`` from block-wise ``codes``.

        ``codes`` and ``qp`` are laid out as the weight is stored: [K, N] with one scale and zero point
        per block of K and column ([n_blocks, N]), or [N, K] and [N, n_blocks] for a Gemm with
        ``transB``. Signed codes are shifted into the op's unsigned range, and a weight whose zero
        points all sit in the middle of that range (symmetric) needs no zero-point input.
        """
        assert qp.block_size is not None  # the plan only sends block-wise weights along K here
        bits = qp.qtype.bits
        offset = 0 if not qp.qtype.signed else 1 << (bits - 1)
        # int16 holds any 8-bit code shifted by the offset: a large weight's codes cost a quarter of int64's
        codes, scale, zero = codes.astype(np.int16), qp.scale.astype(np.float32), qp.zero_point.astype(np.int64)
        if trans_b:
            codes, scale, zero = codes.T, scale.T, zero.T
        zero = zero + offset
        centred = bool(np.all(zero == 1 << (bits - 1)))
        assert spec.accuracy_level is not None  # a weight scheme carries the config's accuracy_level
        packed = pack_codes(
            codes + offset, scale, None if centred else zero, bits, qp.block_size, accuracy_level=spec.accuracy_level
        )
        prefix = self.names.new(f"{node.input[1]}/nbits")
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        product = self.names.new(f"{node.name}/product") if bias else node.output[0]
        built = make_matmul_nbits(packed, node.input[0], product, prefix=prefix, node_name=node.name)
        self.graph.initializer.extend(built.initializers)
        self.contrib_ops = True
        if bias is None:
            return [built.node]
        add = helper.make_node("Add", [product, bias], [node.output[0]], name=self.names.new(f"{node.name}/BiasAdd"))
        return [built.node, add]

    def fp16(self, name: str, values: np.ndarray, output: str) -> None:
        """Store ``values`` as float16 and make a Cast back to float write ``output``."""
        peak = float(np.abs(values).max(initial=0.0))
        if peak > float(np.finfo(np.float16).max):
            raise QtoolError(
                f"weight {name} holds {peak:g}, beyond float16's range (65504)",
                hint="keep this node in float or quantize it to an integer dtype",
            )
        stored = self.names.new(f"{name}/fp16")
        self.graph.initializer.append(numpy_helper.from_array(values.astype(np.float16), stored))
        self.prologue.append(
            helper.make_node("Cast", [stored], [output], name=self.names.new(f"{name}/Cast"), to=TensorProto.FLOAT)
        )
