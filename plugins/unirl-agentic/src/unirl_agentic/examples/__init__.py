"""Example agents for ``rollout.controller: openai_agent`` (written only against the ``openai`` client)."""
