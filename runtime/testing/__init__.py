"""The test kit for durable functions and agents, and its pytest plugin."""
