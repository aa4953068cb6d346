"""Text generation with a key/value cache: settings, logits processors, decoding, predict and chat."""
