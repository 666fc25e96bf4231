"""Text in and out of token ids: chat framing and incremental detokenizing."""
