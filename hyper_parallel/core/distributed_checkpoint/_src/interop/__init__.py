"""Foreign formats as leaves: Hugging Face safetensors, torch DCP, HyperParallel's DCP and
single-file API, MindSpore. Each reads or writes through the layers below; none is imported by them."""
