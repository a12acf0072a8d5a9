"""One ``flatten_mm::QuadTreeLevel`` node as a whole ONNX model, for the tests that run the
ONNX Runtime operator on its own (tests/test_deploy/test_ort_custom_ops.py,
tests/test_reliability/test_native_inputs.py)."""
from onnx import TensorProto, helper

#: the node's inputs, in the operator's order
INPUTS = ['q', 'k', 'v', 'prev_idx', 'prev_score', 'init']


def level_model(domain: str, type_a: bool, width: int, scale: float, topk: int) -> bytes:
    """The serialized model: inputs ``q, k, v, prev_idx, prev_score, init`` of any shape,
    outputs ``msg, next_idx, next_score``."""
    node = helper.make_node('QuadTreeLevel', INPUTS, ['msg', 'next_idx', 'next_score'],
                            domain=domain, width=width, scale=scale, topk=topk,
                            type_a=int(type_a))
    inputs = [helper.make_tensor_value_info(
        n, TensorProto.INT64 if n == 'prev_idx' else TensorProto.FLOAT, None) for n in INPUTS]
    outputs = [helper.make_tensor_value_info('msg', TensorProto.FLOAT, None),
               helper.make_tensor_value_info('next_idx', TensorProto.INT64, None),
               helper.make_tensor_value_info('next_score', TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph([node], 'level', inputs, outputs),
                              opset_imports=[helper.make_opsetid('', 18),
                                             helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    return model.SerializeToString()
