"""What a run reads: corpora, token shards, images and users' datasets, and the loader that
streams each pipeline's shard of them in a reproducible, resumable order."""
