"""Text to training batches: C4 fetch, SentencePiece shards, span corruption, the streaming loader, task sets."""

IGNORE_INDEX = -100  # the label of a target position the loss skips (padding): torch's and HF's default
