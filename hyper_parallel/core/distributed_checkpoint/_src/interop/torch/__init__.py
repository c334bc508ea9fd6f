"""torch DCP: its older call forms, its format on disk (export and import), ``torch.save`` files."""
