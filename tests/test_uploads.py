"""``ubatch.uploads``: the values and dtype arrive, host tensors are not changed, device tensors
pass through, and on a GPU the pinned, non-blocking path delivers the values while an upload inside
a graph capture is refused by name."""

import pytest
import torch

from ubatch.uploads import host_and_device, upload


def test_upload_sequence_and_tensor_on_cpu():
    out = upload([3, -1, 7], torch.int64, torch.device("cpu"))
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 7]
    source = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    out = upload(source, torch.int32, "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [[1, 2], [3, 4]]
    assert source.dtype == torch.int64


def test_host_and_device_returns_both_copies():
    host, device = host_and_device([0, 5, 9], torch.int32, torch.device("cpu"))
    assert host.dtype == device.dtype == torch.int32
    assert host.tolist() == device.tolist() == [0, 5, 9]


def test_empty_values():
    assert upload([], torch.int64, "cpu").shape == (0,)


@pytest.mark.cuda
def test_upload_to_gpu_without_sync_and_refused_under_capture():
    device = torch.device("cuda")
    values = list(range(-5, 300))
    out = upload(values, torch.int64, device)
    assert out.device.type == "cuda" and out.tolist() == values
    on_device = torch.arange(4, device=device)
    assert upload(on_device, torch.int64, device).data_ptr() == on_device.data_ptr()

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            upload([4, 5, 6], torch.int64, device)
