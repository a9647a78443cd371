"""Examples: agents registered from modules of your own (DAR_AGENT_MODULES)."""
