"""Tensor subclasses that wrap one tensor holding their values, and which attribute holds it.

torchao's float8 training (``convert_to_float8_training`` with
``enable_fsdp_float8_all_gather=True``, as torchtitan runs it) turns every Linear weight into a
``WeightWithDynamicFloat8CastTensor``: a wrapper that owns no storage and keeps the
high-precision weight in ``_tensor``, casting to float8 only inside matmuls and FSDP2's
all-gather. Its values *are* that inner tensor's: same shape, same dtype, same bytes. So a
checkpoint of such a subclass is read as its inner tensor (``torch.save`` pickles it as that
tensor plus the wrapper's type and attributes), and a destination of that subclass is written
through its inner tensor.

Only subclasses listed here are read or written through: another subclass (a float8 tensor
holding scaled float8 bits, a quantized tensor, a sparse layout) keeps its values in a form only
its own code can interpret, and a name or a shape cannot tell which of its parts is meant.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Qualified class name (``module.qualname``, as pickles and ``torch.serialization`` name
#: globals) -> the attribute holding the tensor of the wrapper's values.
WRAPPED_VALUES: Mapping[str, str] = {
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": "_tensor",
}


def values_attribute(qualified_name: str) -> str | None:
    """The attribute of the subclass ``qualified_name`` that holds its values, if it is one of
    the wrappers above; ``None`` for any other class."""
    return WRAPPED_VALUES.get(qualified_name)
