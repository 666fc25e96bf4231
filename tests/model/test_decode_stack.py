"""A decode step's layers in one C call (kernels/cpu_forward.c) against the same layers run from Python."""

import dataclasses

import pytest
import torch

from streamchat.cache.block_pool import BlockPool
from streamchat.cache.manager import KVCacheManager
from streamchat.config import CacheConfig, ModelConfig
from streamchat.kernels import cpu_forward
from streamchat.model.batch import SeqChunk, StepBatch
from streamchat.model.qlinear import BF16_GROUP_ROWS
from streamchat.model.runner import ModelRunner, load_model

from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)

BS = 16


@pytest.fixture(autouse=True, scope="module")
def kernels():
    return require_kernels()


class Pair:
    """Two runners over one model, fed the same prompts: `a` decodes through the stack, `b` through the
    Python layers (the model's stack switched off for its calls)."""

    def __init__(self, loaded, kv_dtype: str, lengths=(5, 19, 40, 7, 11)) -> None:
        self.loaded = loaded
        cache = CacheConfig(block_size=BS, num_blocks=32, window_tokens=1024, kv_dtype=kv_dtype)
        self.runners = [ModelRunner(loaded, cache, max_batch=4), ModelRunner(loaded, cache, max_batch=4)]
        self.mgrs = [KVCacheManager(BlockPool(r.num_blocks), BS, 4, 1024) for r in self.runners]
        self.seqs = [[m.new_seq() for _ in lengths] for m in self.mgrs]
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in lengths]
        for i in range(2):
            self.run(i, StepBatch(prefill=[self._chunk(i, s, p) for s, p in zip(self.seqs[i], prompts)]))

    def _chunk(self, i: int, seq, ids) -> SeqChunk:
        placed = self.mgrs[i].append(seq, ids)
        return SeqChunk(ids, placed.positions, placed.slots, list(seq.block_ids), True)

    def run(self, i: int, batch: StepBatch) -> torch.Tensor:
        model = self.loaded.model
        stack = model.stack
        if i == 1:
            model.stack = None
        try:
            return self.runners[i].execute(batch).clone()
        finally:
            model.stack = stack

    def decode(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of the first len(tokens) sessions, in both runners."""
        return tuple(self.run(i, StepBatch(decode=[self._chunk(i, s, [t]) for s, t in zip(self.seqs[i], tokens)]))
                     for i in range(2))


@pytest.fixture
def calls(bundled_fp32, monkeypatch):
    """What each `DecodeStack.run` of the bundled model answered."""
    seen = []
    run = cpu_forward.DecodeStack.run

    def spy(self, *args, **kwargs):
        seen.append(run(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(cpu_forward.DecodeStack, "run", spy)
    return seen


# The largest logit differences measured over these steps (float32 model, logits of magnitude ~20):
# 6.7e-4 over a float pool (silu's exp and the order of a few sums differ by an ulp, carried through
# thirty layers), 2.1e-2 over an int8 pool (an ulp can flip a key's rounding to 8 bits).
TOLERANCE = {"float": 5e-3, "int8": 1e-1}


@pytest.mark.parametrize("kv_dtype", ["float", "int8"])
def test_stack_gives_the_python_layers_logits(bundled_fp32, calls, kv_dtype):
    """Five sessions (1 to 5 rows: the grouped products' direct and panel paths), five steps."""
    pair = Pair(bundled_fp32, kv_dtype)
    assert calls == []  # the prompts' prefill ran the Python layers
    tokens = [1, 2, 3, 4, 5]
    for rows in (3, 5, 1, 2, 5):
        got, want = pair.decode(tokens[:rows])
        torch.testing.assert_close(got, want, atol=TOLERANCE[kv_dtype], rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tokens = want.argmax(-1).tolist() + tokens[len(want):]
    assert calls == [True] * 5  # every decode step of runner a, none of b's
    # the keys and values the stack wrote match what the layers wrote, in every layer: float rows within
    # a few ulps, int8 codes at most one apart (a rounding flip) with their scales within 1e-3
    for ka, kb in zip(pair.runners[0].kv_caches, pair.runners[1].kv_caches):
        for ta, tb in zip(ka, kb):
            if ta is None:
                continue
            if ta.dtype == torch.int8:
                assert (ta.int() - tb.int()).abs().max() <= 1
            else:
                torch.testing.assert_close(ta, tb, atol=1e-3, rtol=1e-3)


def test_stack_is_built_for_the_bundled_model_in_float32(bundled_fp32):
    """The GGUF's 4-bit groups in every projection, no bias: the stack; decode activations as configured."""
    stack = bundled_fp32.model.stack
    assert stack is not None and len(stack.layers) == bundled_fp32.model.shape.num_layers and not stack.x8


def test_steps_it_does_not_take_run_the_python_layers(bundled_fp32, calls):
    """A prefill (or mixed) step, an fp8 pool and attention mass (h2o) go through the Python layers."""
    pair = Pair(bundled_fp32, "fp8")
    got, want = pair.decode([1, 2, 3])
    assert calls == [False]  # asked, declined: the fp8 pool is written by the reference
    assert torch.equal(got, want)
    calls.clear()
    pair = Pair(bundled_fp32, "float")  # prefill only: never asked
    assert calls == []
    runner = pair.runners[0]
    batch = StepBatch(decode=[pair._chunk(0, s, [7]) for s in pair.seqs[0]])
    ids, pos, meta, rows = runner.prepare(batch)
    mass = torch.zeros(len(batch.decode), meta.decode.block_tables.shape[1])
    runner.model.forward(ids, pos, meta, runner.kv_caches, rows, block_mass=mass)
    assert calls == [] and mass.sum() > 0  # the Python layers filled the attention mass


@pytest.mark.parametrize("activations,rounded,mask", [("int8", (True,) * 5, 15),
                                                      ("mixed", (False, True, False, True, True), 2 | 8)])
def test_eight_bit_activations_take_the_stack_too(activations, rounded, mask):
    """--decode-activations int8 (every product) or mixed (o and down; the head is outside the stack): the
    stack multiplies as the layers do (group_linear_x8 where they do, float32 elsewhere). Compared over the
    first two layers: through all thirty, rounding x to 8 bits is chaotic (measured: a relative change of
    1e-7 in the embeddings moved the Python layers' last hidden state by 45 where it reaches 121), so an
    ulp of difference (silu's exp) grows as large; after two layers the stack was 5.7e-6 from the layers."""
    loaded = load_model(dataclasses.replace(ModelConfig(dtype="float32"), decode_activations=activations))
    model = loaded.model
    first = model.layers[0]
    assert tuple(lin.x8 for lin in (first.qkv, first.o, first.gate_up, first.down, model.lm_head)) == rounded
    model.layers = model.layers[:2]
    model.shape = dataclasses.replace(model.shape, num_layers=2)
    model.stack = model._stack()
    assert model.stack is not None and model.stack.x8 == mask and len(model.stack.layers) == 2
    pair = Pair(loaded, "float")
    got, want = pair.decode([1, 2, 3])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_a_bfloat16_model_runs_its_few_rows_through_the_stack(bundled_fp32, calls):
    """bfloat16: up to BF16_GROUP_ROWS rows take the stack, in float32 throughout (over bfloat16 keys and
    values), where the Python layers round every activation to bfloat16; more rows take the GEMM. Over
    three steps the stack's logits are nearer the float32 model's than the Python layers' are (one step
    alone can go either way: on an Intel Xeon 0.088 against 0.179, then 0.096 against 0.073 once the
    products' rounding changed; the three together 0.28 against 0.43-0.64)."""
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    assert loaded.model.stack is not None and loaded.model.stack.max_rows == BF16_GROUP_ROWS
    pair, truth = Pair(loaded, "float"), Pair(bundled_fp32, "float")
    tokens, stack_error, python_error = [1, 2, 3], 0.0, 0.0
    for _ in range(3):
        got, want = pair.decode(tokens)
        exact = truth.decode(tokens)[1]
        stack_error += (got - exact).abs().mean().item()
        python_error += (want - exact).abs().mean().item()
        assert torch.equal(got.argmax(-1), exact.argmax(-1))
        tokens = exact.argmax(-1).tolist()
    assert stack_error < python_error
    assert calls == [True] * 6  # each step: the bfloat16 runner's and the float32 model's runner a
    calls.clear()
    pair.decode(tokens + [4, 5])  # five rows: past the stack's
    assert calls == [False]
