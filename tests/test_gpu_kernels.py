"""The fused pack/unpack kernel against torch: odd sizes, misaligned
addresses, many tiny tensors, fp32/bf16/fp16 both ways, and poisoned
destinations to prove every element (and nothing else) is written."""
import pytest
import torch

from tests.gpu import HAVE_GPU, requires_gpu

pytestmark = requires_gpu
if HAVE_GPU:
    from dearcomm import _C_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ODD_SIZES = [1, 3, 17, 7 * 15, 17 * 257, (1 << 20) + 3]


def poisoned_slots(sizes, dtype, first_offset, gap):
    """Views into one NaN-filled buffer at deliberately odd offsets."""
    total = first_offset + sum(sizes) + gap * len(sizes)
    buffer = torch.full((total,), float("nan"), dtype=dtype, device="cuda")
    slots, offset = [], first_offset
    for n in sizes:
        slots.append(buffer[offset:offset + n])
        offset += n + gap
    return buffer, slots


def expected(source, dtype, scale):
    return (source.float() * scale).to(dtype)


@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("first_offset", [0, 1, 3])
def test_odd_sizes_and_misaligned_offsets(src_dtype, dst_dtype, first_offset):
    torch.manual_seed(0)
    sources = [torch.randn(n, device="cuda").to(src_dtype) for n in ODD_SIZES]
    buffer, slots = poisoned_slots(ODD_SIZES, dst_dtype, first_offset, gap=5)
    _C_cuda.fused_copy(sources, slots, 0.5)
    torch.cuda.synchronize()
    for source, slot in zip(sources, slots):
        torch.testing.assert_close(slot, expected(source, dst_dtype, 0.5), rtol=0, atol=0)
    written = sum(ODD_SIZES)
    assert torch.isnan(buffer.float()).sum().item() == buffer.numel() - written, "wrote outside the slots"


def test_many_tiny_tensors_span_several_launches():
    sizes = [1 + i % 5 for i in range(2000)]  # > 768 segments per launch
    sources = [torch.randn(n, device="cuda") for n in sizes]
    buffer, slots = poisoned_slots(sizes, torch.float32, 1, gap=1)
    _C_cuda.fused_copy(sources, slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.cat(slots), torch.cat(sources), rtol=0, atol=0)
    assert torch.isnan(buffer).sum().item() == buffer.numel() - sum(sizes)


def test_unpack_direction_and_strided_fallback():
    flat = torch.randn(1000, device="cuda")
    contiguous = torch.empty(10, 20, device="cuda", dtype=torch.bfloat16)
    strided = torch.empty(20, 30, device="cuda").t()  # not contiguous: ATen fallback
    _C_cuda.fused_copy([flat[:200].view(10, 20), flat[200:800].view(30, 20)], [contiguous, strided], 2.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(contiguous, expected(flat[:200].view(10, 20), torch.bfloat16, 2.0), rtol=0, atol=0)
    torch.testing.assert_close(strided, flat[200:800].view(30, 20) * 2.0, rtol=0, atol=0)


def test_mismatched_pairs_are_named():
    with pytest.raises(ValueError, match="pair 0 has 3 and 4 elements"):
        _C_cuda.fused_copy([torch.zeros(3, device="cuda")], [torch.zeros(4, device="cuda")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucket_pack_and_unpack_address_slots_by_offset(dtype):
    """The backend's pack/unpack compute each slot from its offset (no view per
    tensor): every element lands at its offset and nothing else is written;
    a strided tensor takes the ATen fallback; a slot past the end is named."""
    torch.manual_seed(0)
    sizes = [3, 17, 4099, 1]
    sources = [torch.randn(n, device="cuda") for n in sizes]
    sources[1] = torch.randn(17, 2, device="cuda")[:, 0]  # strided
    offsets = [1, 9, 40, 5000]
    flat = torch.full((5003,), float("nan"), dtype=dtype, device="cuda")
    _C_cuda.pack_into(sources, offsets, flat, 0.5)
    torch.cuda.synchronize()
    for source, offset in zip(sources, offsets):
        torch.testing.assert_close(flat[offset:offset + source.numel()], expected(source, dtype, 0.5), rtol=0, atol=0)
    assert torch.isnan(flat.float()).sum().item() == flat.numel() - sum(sizes), "wrote outside the slots"
    back = [torch.empty(n, dtype=dtype, device="cuda") for n in sizes]
    back[2] = torch.empty(4099, 2, dtype=dtype, device="cuda")[:, 0]  # strided
    _C_cuda.unpack_from(flat, offsets, back)
    torch.cuda.synchronize()
    for out, offset in zip(back, offsets):
        torch.testing.assert_close(out, flat[offset:offset + out.numel()], rtol=0, atol=0)
    with pytest.raises(ValueError, match="tensor 0 .4 elements at offset 5000. does not fit the bucket of 5003"):
        _C_cuda.pack_into([torch.zeros(4, device="cuda")], [5000], flat)
    with pytest.raises(ValueError, match="got 1 tensors and 2 offsets"):
        _C_cuda.unpack_from(flat, [0, 1], [back[0]])
