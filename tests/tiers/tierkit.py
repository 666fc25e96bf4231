"""Small layouts and snapshots for the tier tests (no model needed)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from streamchat.model.kv_spec import FullAttentionSpec, MLAAttentionSpec
from streamchat.tiers import kvfile
from streamchat.tiers.kvfile import ANY_MARK, KVFileError, KVLayout, SeqState, Snapshot, expected_tensors

VOCAB = 1000  # the snapshots' token ids are below it
SID = "sess_" + "ab" * 16  # snapshot()'s session


def layout(num_layers=2, num_kv_heads=3, head_dim=32, mla=None, **changes) -> KVLayout:
    """A layout of `num_layers` full-attention layers, or MLA layers of mla = (latent_dim, rope_dim)."""
    base = dict(model_fingerprint="fp-test", model_dtype="torch.bfloat16", kv_dtype="auto", block_size=16,
                sink_tokens=4, window_tokens=64, pin_system_prompt=True)
    lay = {**base, **changes}
    dtype = getattr(torch, lay["model_dtype"].removeprefix("torch."))
    if mla is None:
        spec = FullAttentionSpec(lay["block_size"], num_kv_heads, head_dim, dtype, lay["kv_dtype"])
    else:
        spec = MLAAttentionSpec(lay["block_size"], *mla, dtype, lay["kv_dtype"])
    return KVLayout(**lay, kv_specs=(spec,) * num_layers)


def random_tensor(dtype, shape, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 120, shape, generator=gen).to(dtype)


def snapshot(lay: KVLayout, session_id=SID, num_tokens=40, seed=0, mark="m1") -> Snapshot:
    gen = torch.Generator().manual_seed(seed)
    state = SeqState(token_ids=[(7 * i + seed) % 1000 for i in range(num_tokens)], num_sink_blocks=1,
                     pinned_tokens=0, pristine=False, evicted_tokens=32, total_tokens=num_tokens + 32)
    num_blocks = state.num_blocks(lay.block_size)
    tensors = {name: random_tensor(dtype, (num_blocks, *tail), gen)
               for name, (dtype, tail) in expected_tensors(lay).items()}
    return Snapshot(session_id, state, tensors, mark)


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def refused(path, lay, session_id=SID, mark=ANY_MARK, vocab_size=VOCAB) -> tuple[str, str]:
    """(reason, message) of the KVFileError reading `path` raises."""
    with pytest.raises(KVFileError) as err:
        kvfile.read(path, lay, session_id, mark, vocab_size=vocab_size)
    return err.value.reason, str(err.value)


def write_raw(path, header: dict | None, tensors: dict, header_json: str | None = None,
              checksum=kvfile.checksum) -> None:
    """A file with this header (or this header JSON) and these tensors under `checksum(text, tensors)`: by
    default one that holds, as a writer that erred would."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":")) if header_json is None else header_json
    save_file(tensors, str(path), metadata={"streamchat": text, "checksum": checksum(text, tensors)})
