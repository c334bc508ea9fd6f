"""Hugging Face safetensors directories: read, written, exported, imported, consolidated."""
