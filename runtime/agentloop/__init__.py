"""The agent loop: the model decides, tools run, repeat; and the demo agent."""
