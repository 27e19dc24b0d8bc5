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


# ---- partitioning (layout v2): a parameter may span buckets ------------------

def plan_partitioned(numels, cap_bytes, world_size, partition_bytes, dtypes=None):
    return _C.plan_buckets(numels, dtypes or [F32] * len(numels), cap_bytes, world_size, partition_bytes)


def covered_elements(layout):
    """(param, element) for every data element of every bucket, via pieces."""
    out = []
    for b, bucket in enumerate(layout.buckets):
        for rank in range(layout.world_size):
            begin = rank * bucket.shard_numel
            for piece in layout.pieces(b, begin, begin + bucket.shard_numel):
                assert begin <= piece.bucket_offset and piece.bucket_offset + piece.numel <= begin + bucket.shard_numel
                # where the piece sits in the flat buffer is where its parameter's elements are
                assert (bucket.buffer_offset + piece.bucket_offset
                        == layout.buffer_offset(piece.param) + piece.param_offset)
                out += [(piece.param, piece.param_offset + i) for i in range(piece.numel)]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("partition_bytes", [1, 1000, 4 * 1001, 64 * 1024])
@pytest.mark.parametrize("cap_bytes", [0, 40, 10**9])
def test_partitions_cover_every_element_once_and_stay_under_the_size(world_size, partition_bytes, cap_bytes):
    """Guards against lost or doubled elements at split points (odd tensor
    sizes, odd partition sizes) and against buckets over the partition size."""
    numels = [37 * 13, 1, 4099, 3, 1001, 8, 17 * 257]
    layout = plan_partitioned(numels, cap_bytes, world_size, partition_bytes)
    unit = _C.partition_unit(world_size, F32)
    limit = max(unit, partition_bytes // 4 // unit * unit)
    assert sorted(covered_elements(layout)) == [(p, i) for p, n in enumerate(numels) for i in range(n)]
    offset = 0
    for b, bucket in enumerate(layout.buckets):
        assert bucket.numel > 0
        assert bucket.padded_numel <= limit
        assert bucket.buffer == 0 and bucket.buffer_offset == offset  # one flat buffer, consecutive ranges
        offset += bucket.padded_numel
        last = layout.params[bucket.first_param + bucket.num_params - 1]
        if last.last_bucket > b:  # split here: full, no padding, on the unit
            assert bucket.numel == bucket.padded_numel == limit and limit % unit == 0
    assert layout.buffer_numels == [offset]
    for p, slot in enumerate(layout.params):
        assert slot.offset % 8 == 0 and slot.bucket <= slot.last_bucket
        if numels[p] <= limit:
            assert slot.bucket == slot.last_bucket, f"parameter {p} fits in a partition but was cut"
        else:
            assert slot.offset == 0, f"parameter {p} is split but does not start its own bucket"
        spans = [b for b in range(len(layout.buckets)) if any(x.param == p for x in layout.pieces(b, 0, 2**62))]
        assert spans == list(range(slot.bucket, slot.last_bucket + 1))


def test_a_large_tensor_is_split_into_partition_sized_buckets():
    unit = _C.partition_unit(2, F32)  # 2 ranks x 16 floats
    layout = plan_partitioned([10, 1000, 6], 0, 2, 256 * 4)  # 256 floats per partition
    assert unit == 32
    assert [(b.first_param, b.num_params, b.numel) for b in layout.buckets] == [
        (0, 1, 10), (1, 1, 256), (1, 1, 256), (1, 1, 256), (1, 1, 232), (2, 1, 6)]
    assert [(s.bucket, s.last_bucket) for s in layout.params] == [(0, 0), (1, 4), (5, 5)]
    assert "(split)" in layout.describe() and "(cont.)" in layout.describe()


def test_small_tensors_fuse_up_to_the_partition_and_one_that_does_not_fit_starts_the_next():
    # No fusion cap (inf), partition 64 floats at world size 1 (unit 16).
    layout = plan_partitioned([20, 20, 40, 8], 2**62, 1, 64 * 4)
    assert [(s.bucket, s.offset, s.last_bucket) for s in layout.params] == [(0, 0, 0), (0, 24, 0), (1, 0, 1),
                                                                           (1, 40, 1)]
    assert [b.numel for b in layout.buckets] == [44, 48]  # 40 fits a partition: never cut, it moves on


def test_a_large_tensor_starts_its_own_buckets_and_the_next_module_does_not_share_them():
    """widein's shape (a 16-partition first weight, its bias, a 4-partition
    weight): before, the bias opened a bucket that the next weight's head
    filled, so the first module waited for that weight too."""
    part = 4096  # floats; unit at world size 4 is 64
    layout = plan_partitioned([10, 4 * part, 1024, part, 1024, 3 * part + 100], 2**62, 4, part * 4)
    assert [(s.bucket, s.last_bucket) for s in layout.params] == [(0, 0), (1, 4), (5, 5), (6, 6), (7, 7), (8, 11)]
    assert [b.numel for b in layout.buckets] == [10] + [part] * 4 + [1024, part, 1024] + [part] * 3 + [100]
    first_module = range(layout.params[1].bucket, layout.params[2].last_bucket + 1)  # weight 1 and its bias 2
    assert sum(layout.buckets[b].numel for b in first_module) == 4 * part + 1024


def test_each_dtype_has_its_own_flat_buffer():
    layout = plan_partitioned([100, 100, 100], 0, 2, 64 * 4, [F32, torch.bfloat16, F32])
    assert [b.buffer for b in layout.buckets if b.dtype == F32] == [0] * 4
    assert {b.buffer for b in layout.buckets if b.dtype == torch.bfloat16} == {1}
    f32 = [b for b in layout.buckets if b.dtype == F32]
    assert [b.buffer_offset for b in f32] == [0, 64, 128, 192]  # the third tensor continues buffer 0
    assert sorted(covered_elements(layout)) == [(p, i) for p in range(3) for i in range(100)]


def test_without_partitioning_nothing_is_split():
    numels = [37 * 13, 1, 4099, 3, 1001]
    for cap in (0, 40, 10**9):
        layout = plan(numels, cap, 3)
        assert all(s.bucket == s.last_bucket for s in layout.params)


def test_bad_partition_size_is_named():
    with pytest.raises(ValueError, match="partition size must be > 0"):
        plan_partitioned([3], 0, 2, 0)


def test_explicit_blocks_make_one_bucket_per_piece_and_nothing_else_moves():
    """A planner's unequal pieces (US-Byte): each piece is one bucket, split
    buckets need no padding, and parameters without blocks are planned as
    without them."""
    unit = _C.partition_unit(2, F32)  # 32
    numels = [10, 20, 6 * unit + 5, 7, 9]
    layout = _C.plan_buckets(numels, [F32] * 5, 10**9, 2, blocks=[[], [], [unit, 4 * unit, unit + 5], [], []])
    assert [(b.first_param, b.num_params, b.numel) for b in layout.buckets] == [
        (0, 2, 36), (2, 1, unit), (2, 1, 4 * unit), (2, 1, unit + 5), (3, 2, 17)]
    assert all(b.numel == b.padded_numel for b in layout.buckets[1:3])  # split: no padding
    slot = layout.params[2]
    assert slot.offset == 0 and slot.last_bucket - slot.bucket == 2
    assert layout.params[3].bucket == slot.last_bucket + 1  # the next parameter starts afresh
    assert sorted(covered_elements(layout)) == [(p, i) for p, n in enumerate(numels) for i in range(n)]
    unblocked = plan(numels[:2], 10**9, 2)
    assert [(s.bucket, s.offset) for s in layout.params[:2]] == [(s.bucket, s.offset) for s in unblocked.params]


@pytest.mark.parametrize("blocks, message", [
    ([[], [33, 68]], "block 0 of parameter 1 has 33 elements; every block but the last must be a multiple of "
                     "partition_unit = 32"),
    ([[], [32, 32]], "the blocks of parameter 1 add up to 64 elements, but it has 101"),
    ([[], [0, 101]], "block 0 of parameter 1 has 0 elements"),
    ([[101]], "got blocks for 1 parameters, expected none or 2"),
])
def test_bad_blocks_are_named(blocks, message):
    with pytest.raises(ValueError, match=message):
        _C.plan_buckets([7, 101], [F32, F32], 0, 2, blocks=blocks)
