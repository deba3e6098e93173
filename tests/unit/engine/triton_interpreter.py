"""Triton's interpreter, patched where it falls short of the kernels: the engine's and the
trainer's kernel checks run under it on CPU (each in a process of its own, as a script)."""

from __future__ import annotations

import torch


def patch_triton_interpreter() -> None:
    """Three gaps of Triton's interpreter (3.6 to 3.9), not of the kernels: it indexes with a
    loaded scalar by int() of a 1-element array (an error from numpy 2.4), it stores bfloat16 as
    raw uint16, truncating casts and multiplying the raw bits in tl.dot, and its float32 →
    float8e4nv cast drops the rounding's carry (a tenth of the bytes came out wrong). Patched to
    match the GPU, whose casts round to nearest even."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    patch_tensor, convert, dot = interp._patch_lang_tensor, interp._convert_float, interp.InterpreterBuilder.create_dot

    def patch_tensor_(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def convert_(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:  # round to nearest even, as the GPU does
            return (
                torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
                .to(torch.bfloat16)
                .view(torch.int16)
                .numpy()
                .view(np.uint16)
            )
        if src == tl.float32 and dst == tl.float8e4nv:  # the same (kernels clamp to ±448 first)
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(data, src, dst, rounding)

    def dot_(self, a, b, d, *rest):
        if a.dtype == tl.bfloat16:
            a, b = (interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32) for x in (a, b))
        return dot(self, a, b, d, *rest)

    interp._patch_lang_tensor, interp._convert_float, interp.InterpreterBuilder.create_dot = (
        patch_tensor_,
        convert_,
        dot_,
    )
