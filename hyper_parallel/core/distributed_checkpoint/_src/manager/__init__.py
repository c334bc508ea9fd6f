"""The checkpoint manager: step directories, retention, resume, and the node-local tier with
its peer replication and recovery."""
