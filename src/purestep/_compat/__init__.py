"""Guarded access to the private torch and tensordict internals purestep uses.

Every private call the library makes on a hot path goes through a name bound
here once, at import: the private internal when a probe on a tiny input shows
it exists and gives the answer purestep relies on, else a public path that
gives the same result, only slower. So a torch or tensordict release that
removes or changes an internal costs speed, never correctness. Each internal
that falls back emits one :class:`CompatWarning` naming it, and is listed in
:data:`FALLBACKS`. ``docs/internals.md`` is the register of these internals.

Setting the environment variable ``PURESTEP_COMPAT=public`` before purestep is
imported forces every fallback (tests use it to run the optimizer parity and
checkpoint round-trip tests on the public paths). The probes run then too, so
they stay exercised; their result is ignored.

Call sites read one attribute (``_compat.foreach_add_(...)``, ``type(td) is
_compat.PLAIN_TD``): there is no per-call probing or dispatch. This package
re-exports every name from its modules, one per concept: ``_probe`` (the
probe-and-choose machinery: ``FORCE_PUBLIC``, ``FALLBACKS``, ``CompatWarning``),
``_tensordict``, ``_module`` (``nn.Module`` slots), ``_foreach``, ``_fused``
(fused optimizer kernels) and ``_records`` (checkpoint records); each binds its
names, probing once, when this package is imported.

Example:
    >>> import torch
    >>> from purestep import _compat
    >>> x = [torch.ones(2)]
    >>> _ = _compat.foreach_add_(x, [torch.ones(2)], alpha=2.0)
    >>> x[0]
    tensor([3., 3.])
"""

from __future__ import annotations

from purestep._compat._foreach import _loop_add as _loop_add
from purestep._compat._foreach import _loop_add_ as _loop_add_
from purestep._compat._foreach import _loop_addcdiv_ as _loop_addcdiv_
from purestep._compat._foreach import _loop_addcmul_ as _loop_addcmul_
from purestep._compat._foreach import _loop_copy_ as _loop_copy_
from purestep._compat._foreach import _loop_div_ as _loop_div_
from purestep._compat._foreach import _loop_lerp as _loop_lerp
from purestep._compat._foreach import _loop_lerp_ as _loop_lerp_
from purestep._compat._foreach import _loop_maximum_ as _loop_maximum_
from purestep._compat._foreach import _loop_mul_ as _loop_mul_
from purestep._compat._foreach import _loop_norm as _loop_norm
from purestep._compat._foreach import _loop_sign_ as _loop_sign_
from purestep._compat._foreach import _loop_sqrt as _loop_sqrt
from purestep._compat._foreach import _loop_sub_ as _loop_sub_
from purestep._compat._foreach import (
    foreach_add,
    foreach_add_,
    foreach_addcdiv_,
    foreach_addcmul_,
    foreach_copy_,
    foreach_div_,
    foreach_lerp,
    foreach_lerp_,
    foreach_maximum_,
    foreach_mul_,
    foreach_norm,
    foreach_sign_,
    foreach_sqrt,
    foreach_sub_,
)
from purestep._compat._fused import _public_fused_adam as _public_fused_adam
from purestep._compat._fused import _public_fused_sgd as _public_fused_sgd
from purestep._compat._fused import fused_adam_, fused_adamw_, fused_sgd_
from purestep._compat._module import _ALWAYS_TO_MODULE as _ALWAYS_TO_MODULE
from purestep._compat._module import registration_hooks
from purestep._compat._probe import FALLBACKS, FORCE_PUBLIC, CompatWarning
from purestep._compat._probe import _choose as _choose
from purestep._compat._probe import _clone as _clone
from purestep._compat._probe import _probe_tensors as _probe_tensors
from purestep._compat._probe import _same as _same
from purestep._compat._records import (
    NON_ZIP_RECORDS,
    cpu_loader,
    narrow_tensor_by_index,
    save_record,
)
from purestep._compat._records import _narrow_public as _narrow_public
from purestep._compat._records import _private_cpu_loader as _private_cpu_loader
from purestep._compat._records import _PublicCpuLoader as _PublicCpuLoader
from purestep._compat._records import _save_public as _save_public
from purestep._compat._tensordict import PLAIN_TD, new_td
from purestep._compat._tensordict import _new_td_public as _new_td_public

__all__ = [
    "FALLBACKS",
    "FORCE_PUBLIC",
    "NON_ZIP_RECORDS",
    "PLAIN_TD",
    "CompatWarning",
    "cpu_loader",
    "foreach_add",
    "foreach_add_",
    "foreach_addcdiv_",
    "foreach_addcmul_",
    "foreach_copy_",
    "foreach_div_",
    "foreach_lerp",
    "foreach_lerp_",
    "foreach_maximum_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sign_",
    "foreach_sqrt",
    "foreach_sub_",
    "fused_adam_",
    "fused_adamw_",
    "fused_sgd_",
    "narrow_tensor_by_index",
    "new_td",
    "registration_hooks",
    "save_record",
]
