"""LoRA adapters: finding and checking an adapter's files against the base model
(adapters.py), the layers that add its terms over one copy of the base weights
(layers.py), and the runner's slots of loaded adapters (manager.py)."""
