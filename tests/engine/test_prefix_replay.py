"""A stateless replay of a conversation (restore from messages) reuses every full block it shares."""

from streamchat.config import CacheConfig, Config, ModelConfig
from streamchat.llm import LLM
from streamchat.model.sampling import SamplingParams

SYSTEM = "You are brief."  # shorter than a block: the shared blocks straddle prompt and transcript


def reply(eng, sid, messages, max_tokens=12):
    """Open `sid` from `messages`, run one greedy reply, close it; (text, usage, token ids)."""
    eng.restore_session(sid, SYSTEM, messages, admit=True)
    eng.start_response(sid, "r" + sid, SamplingParams(), max_tokens)
    while True:
        for e in eng.step():
            if type(e).__name__ == "ResponseFinished":
                eng.close_session(sid)
                eng.check()
                return eng.tokenizer.decode(e.token_ids, skip_special_tokens=True), e.usage, e.token_ids


def test_replayed_chat_takes_its_shared_blocks_and_answers_as_cold(bundled_fp32):
    """Turn 2 re-sends turn 1 and its reply: all full blocks before the new tokens come from the cache,
    and the greedy reply equals one computed with prefix sharing off."""
    def engine(sharing):
        return LLM(Config(model=ModelConfig(dtype="float32"),
                          cache=CacheConfig(num_blocks=300, prefix_sharing=sharing)), loaded=bundled_fp32).engine

    warm, cold = engine(True), engine(False)
    turn1 = [("user", "Name three fruits.", True)]
    text, first, _ = reply(warm, "a", turn1)
    assert first.cached_tokens == 0
    turn2 = turn1 + [("assistant", text, True), ("user", "And three vegetables?", True)]
    _, second, ids = reply(warm, "b", turn2)
    shared = len(warm.chat.bos_ids + warm.chat.message("system", SYSTEM) + warm.transcript_tokens(turn1)
                 + warm.chat.reply_prompt()) + first.output_tokens
    # the last sampled token may not be in the cache yet (a reply cut by max_tokens)
    assert (shared - 1) // 16 * 16 <= second.cached_tokens <= shared // 16 * 16
    assert second.cached_tokens >= 32
    assert reply(cold, "c", turn2)[2] == ids
