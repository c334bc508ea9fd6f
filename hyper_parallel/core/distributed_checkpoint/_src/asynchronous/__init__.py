"""Asynchronous saves: snapshots into reused host buffers, the background writer, responses,
and the process hooks that keep an in-flight save whole."""
