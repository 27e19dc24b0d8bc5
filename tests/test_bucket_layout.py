"""Bucket planning is a pure function: checked here without processes."""
import pytest
import torch

from dearcomm import _C

F32 = torch.float32


def plan(numels, cap_bytes, world_size, dtypes=None):
    return _C.plan_buckets(numels, dtypes or [F32] * len(numels), cap_bytes, world_size)


def test_zero_cap_gives_one_bucket_per_parameter():
    layout = plan([17 * 257, 17, 7 * 15, 1], 0, 3)
    assert [b.num_params for b in layout.buckets] == [1, 1, 1, 1]
    assert [p.bucket for p in layout.params] == [0, 1, 2, 3]
    assert all(p.offset == 0 for p in layout.params)


def test_offsets_follow_forward_order_aligned_to_8_elements():
    """Guards against unaligned parameter starts: after one parameter of odd
    size, every later one would be copied without vector accesses on GPU."""
    layout = plan([10, 3, 1, 700], 10**9, 2)
    assert len(layout.buckets) == 1
    assert [p.offset for p in layout.params] == [0, 16, 24, 32]
    assert layout.buckets[0].numel == 732


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16, torch.float64])
def test_every_parameter_start_is_16_byte_aligned_in_a_2_byte_comm_dtype(dtype):
    numels = [17, 1, 4099, 3, 8, 5]
    layout = plan(numels, 10**9, 3, [dtype] * len(numels))
    slots = list(layout.params)
    assert all(s.offset * 2 % 16 == 0 and s.offset * dtype.itemsize % 16 == 0 for s in slots)
    for a, b in zip(slots, slots[1:]):  # in order, never overlapping, gaps under 8 elements
        assert a.offset + a.numel <= b.offset < a.offset + a.numel + 8


def test_bucket_closes_once_it_reaches_the_cap():
    # 40-byte cap: [10 floats] closes at 40 bytes, then [3, 1, 700] closes on the 700.
    layout = plan([10, 3, 1, 700, 5], 40, 2)
    assert [(b.first_param, b.num_params) for b in layout.buckets] == [(0, 1), (1, 3), (4, 1)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numels", [[1], [17], [17 * 257, 7 * 15], [3, 5, 7, 11]])
def test_padding_splits_into_equal_aligned_shards(world_size, numels):
    layout = plan(numels, 0, world_size)
    align = _C.SHARD_ALIGN_BYTES // 4
    for bucket in layout.buckets:
        assert bucket.padded_numel == bucket.shard_numel * world_size
        assert bucket.padded_numel >= bucket.numel
        assert bucket.shard_numel % align == 0
        # the smallest such padding: one alignment unit less would not hold the data
        assert (bucket.shard_numel - align) * world_size < bucket.numel


def test_dtype_change_starts_a_new_bucket():
    layout = plan([4, 4, 4], 10**9, 2, [F32, F32, torch.bfloat16])
    assert [(b.num_params, b.dtype) for b in layout.buckets] == [(2, F32), (1, torch.bfloat16)]
    # bf16 shards align to 64 bytes = 32 elements
    assert layout.buckets[1].shard_numel == 32


def test_pieces_cover_each_shard_exactly():
    numels = [17 * 257, 17, 7 * 15, 1]
    layout = plan(numels, 10**9, 3)
    bucket = layout.buckets[0]
    covered = []
    for rank in range(3):
        begin = rank * bucket.shard_numel
        for piece in layout.pieces(0, begin, begin + bucket.shard_numel):
            slot = layout.params[piece.param]
            assert piece.bucket_offset == slot.offset + piece.param_offset
            assert begin <= piece.bucket_offset < begin + bucket.shard_numel
            covered += [(piece.param, piece.param_offset + i) for i in range(piece.numel)]
    assert sorted(covered) == [(p, i) for p, n in enumerate(numels) for i in range(n)]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan([3], 0, 0)
    with pytest.raises(ValueError, match="bucket cap must be >= 0"):
        plan([3], -1, 2)
    with pytest.raises(ValueError, match="parameter 1 has no elements"):
        plan([3, 0], 0, 2)
    with pytest.raises(TypeError, match="expected a torch.dtype"):
        _C.plan_buckets([3], ["float32"], 0, 2)


def test_first_bucket_is_small_so_both_ends_of_the_overlap_are():
    mib = 2**20 // 4  # float32 elements per MiB
    layout = plan([mib // 2, mib // 2, mib, 4 * mib, 4 * mib], 25 * 2**20, 2)
    assert _C.FIRST_BUCKET_CAP_BYTES == 2**20
    assert [(b.first_param, b.num_params) for b in layout.buckets] == [(0, 2), (2, 3)]
    assert plan([10, 10], 40, 2).buckets[0].num_params == 1  # a smaller cap still wins
