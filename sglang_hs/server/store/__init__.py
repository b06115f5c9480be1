"""Shared-memory store, output ring, writer and reader of captured hidden states."""
