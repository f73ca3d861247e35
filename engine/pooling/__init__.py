"""Pooling tasks (embed, classify, rerank): which tasks a model serves and how it pools,
read from its directory (config.py), and the pooler that folds computed prompt rows
into embeddings and class scores (pooler.py)."""
