"""CUDA-IPC weight handles as plain data (vime/transport/cuda_ipc.py): what the trainer sends
survives JSON exactly, and a malformed handle is refused by what is wrong with it. (An engine
refusing a handle, or a pickle, is tests/unit/engine/test_server_faults.py's.)"""

from __future__ import annotations

import json

import pytest
import torch

from vime.transport import cuda_ipc


def test_cuda_ipc_handles_travel_as_plain_data():
    """The trainer's side of a CUDA tensor's handle (the arguments reduce_tensor gives
    rebuild_cuda_tensor, written here as it would for a GPU tensor) survives JSON exactly."""
    args = (
        torch.Tensor,
        torch.Size([4, 8]),
        (8, 1),
        2,
        torch.storage.TypedStorage,
        torch.bfloat16,
        0,
        b"\x01" * 66,
        128,
        64,
        False,
        b"\x02" * 66,
        3,
        None,
        False,
    )
    handle = cuda_ipc.from_reduce_args("model.norm.weight", args)
    wire = json.loads(json.dumps([handle.to_json()]))
    assert cuda_ipc.parse(wire) == [handle]
    with pytest.raises(ValueError, match="dtype int64"):
        cuda_ipc.from_reduce_args("x", (*args[:5], torch.int64, *args[6:]))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"storage_cls": "os.system"}, "unknown fields"),
        ({"dtype": "object"}, "dtype 'object'"),
        ({"shape": [4, "8"]}, "shape must be a list of integers"),
        ({"offset": -1}, "offset must be an integer >= 0"),
        ({"handle": "not base64!"}, "handle is not valid base64"),
        ({"storage_size_bytes": 63}, "reach past the 63-byte storage"),
        ({"event_sync_required": "yes"}, "true or false"),
    ],
)
def test_a_malformed_ipc_handle_is_refused(change, match):
    good = cuda_ipc.IpcHandle("w", (4, 8), (8, 1), 0, "float16", 0, b"h", 64, 0, b"r", 0, None, False).to_json()
    with pytest.raises(ValueError, match=match):
        cuda_ipc.parse([{**good, **change}])
