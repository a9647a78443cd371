"""Test doubles that stand in for external services (no network beyond loopback)."""
