"""Steps of every batch size and length compile a bounded number of kernel variants (TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from streamchat.kernels import backend, decode, prefill, write_kv  # noqa: E402
from streamchat.kernels.decode import MAX_SPLITS  # noqa: E402
from streamchat.kernels.variants import Variants, launch_key  # noqa: E402
from streamchat.model.attention import (AttentionMetadata, DecodeGroup, Heads, LayerKV,  # noqa: E402
                                        PrefillGroup, attend, plan_step)

BS, KVH, H, D, NUM_BLOCKS = 4, 1, 2, 16, 40
KERNELS = {decode: ["_decode_split_kernel", "_decode_reduce_kernel"], prefill: ["_prefill_kernel"],
           write_kv: ["_write_kv_kernel"]}


def step(be, kv, decode_lens: list[int], chunks: list[tuple[int, int]], cos, sin) -> None:
    """One step: sequences decoding at decode_lens, chunks of (query_len, seq_len); tables of fresh blocks."""
    gen = torch.Generator().manual_seed(len(decode_lens) * 31 + len(chunks))
    lens = decode_lens + [n for _, n in chunks]
    width = max(-(-n // BS) for n in lens)
    tables = torch.randint(1, NUM_BLOCKS, (len(lens), width), generator=gen, dtype=torch.int32)
    slots = [int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(decode_lens)]
    positions = [n - 1 for n in decode_lens]
    for j, (q, n) in enumerate(chunks):
        row = tables[len(decode_lens) + j]
        positions += list(range(n - q, n))
        slots += [int(row[p // BS]) * BS + p % BS for p in range(n - q, n)]
    nd = len(decode_lens)
    dec = DecodeGroup(tables[:nd], torch.tensor(decode_lens, dtype=torch.int32)) if nd else None
    pre = None
    if chunks:
        cu = torch.tensor([0] + [sum(q for q, _ in chunks[:i + 1]) for i in range(len(chunks))], dtype=torch.int32)
        pre = PrefillGroup(cu, tables[nd:], torch.tensor([n for _, n in chunks], dtype=torch.int32),
                           [q for q, _ in chunks], [n for _, n in chunks])
    meta = AttentionMetadata(torch.tensor(slots), BS, dec, pre)
    plan = plan_step(be, meta, torch.tensor(positions), cos, sin, torch.float32, Heads(H, KVH, D))
    t = len(slots)
    k, v, q = torch.randn(t, KVH, D, generator=gen), torch.randn(t, KVH, D, generator=gen), torch.randn(t, H, D)
    be.write(kv, k, v, plan)
    assert attend(be, q, kv, plan, D ** -0.5).shape == (t, H, D)


def test_steps_of_every_shape_compile_a_bounded_number_of_variants():
    """Batches of 1..9 sequences, tables 1..275 blocks wide (1, 2 and 4 splits), prefill of 1..5 chunks: the split and
    write kernels compile once, the reduce once per power of two of the split count, prefill once
    per power of two of its sequence count."""
    be = backend.TritonBackend()
    kv = LayerKV(torch.zeros(NUM_BLOCKS, BS, KVH, D), torch.zeros(NUM_BLOCKS, BS, KVH, D))
    cos, sin = torch.ones(2048, D), torch.zeros(2048, D)
    splits = set()
    with Variants(KERNELS) as variants:
        for lens in ([1100], [600, 3], [300, 20, 7], [5] * 5, [40] * 9, [1], [2, 9]):
            step(be, kv, lens, [], cos, sin)
            width = max(-(-n // BS) for n in lens)
            splits.add(decode.plan_decode(len(lens), H, KVH, D, width, BS, torch.device("cpu")).part_max.shape[2])
        for chunks in ([(3, 3)], [(5, 9), (1, 17)], [(2, 30), (4, 4), (7, 60)], [(1, 2)] * 5):
            step(be, kv, [6], chunks, cos, sin)
    counts = variants.counts()
    pow2 = {1 << (s - 1).bit_length() for s in splits}
    assert len(splits) >= 3 and len(pow2) <= MAX_SPLITS.bit_length()
    assert counts == {"_decode_split_kernel": 1, "_decode_reduce_kernel": len(pow2),
                      "_prefill_kernel": 3, "_write_kv_kernel": 1}  # SEQS_PAD 2 (1 and 2 seqs), 4, 8


def test_launch_key_follows_tritons_specialization():
    """An int of 1 or a multiple of 16 keys a new variant unless the parameter is not specialized;
    a constexpr's value always does."""
    kernel = decode._decode_reduce_kernel  # num_splits: not specialized; D_PAD: a constexpr
    args = [torch.zeros(4)] * 4

    def key(num_splits, stride_stat_seq=3, d_pad=16):
        return launch_key(kernel, (*args, num_splits, stride_stat_seq, 5, 7, 9),
                          dict(HEAD_DIM=16, D_PAD=d_pad, SPLITS_PAD=1, num_warps=4))

    assert key(1) == key(17) == key(32)
    assert key(1, d_pad=32) != key(1)
    spec = write_kv._write_kv_kernel  # its strides are specialized
    base = [torch.zeros(4)] * 9
    keys = {launch_key(spec, (*base, stride, *[3] * 10), {}) for stride in (1, 16, 17, 18)}
    assert len(keys) == 3  # 1: a constant; 16: aligned; 17 and 18: plain
