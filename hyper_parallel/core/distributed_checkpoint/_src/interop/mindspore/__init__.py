"""MindSpore: ``..ckpt`` and MindSpore safetensors files, distributed checkpoints, strategy files."""
