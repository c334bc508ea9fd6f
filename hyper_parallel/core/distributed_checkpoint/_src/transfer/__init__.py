"""Moving bytes: the saver and loader that execute plans against storage, shared reads of
replicated data, host copies and accelerator stream ordering."""
