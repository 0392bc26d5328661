"""The OpenAI-compatible endpoint an agent harness drives the policy through (docs/agent_harness.md).

``server.AgentEndpoint`` serves ``/v1/chat/completions`` and ``/v1/models`` with one key per episode;
``session.EndpointSession`` turns one episode's requests into exact-token trajectories (message-level
prefix match, never re-tokenising the model's turns; a rewritten history starts a new segment);
``tools.ToolFormat`` renders and parses OpenAI function calls in the model's template;
``messages`` is the canonical form requests are compared in; ``episode.run_harness_episode`` runs one
harness environment's episode against a session.
"""
