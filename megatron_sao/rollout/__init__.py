"""The rollout side: prompts in, one finished ``Trajectory`` per prompt out, weights in after each actor step.

The top level is the episode side, in the order data flows::

    prompts.PromptStream            the training prompts, one unit of work per episode
    episode_driver.EpisodeDriver    keeps episodes in flight under admission control (asyncio thread)
    server_pool.ServerPool          places each episode on the least-loaded live engine, for all its turns
    agent_loop.run_episode          generate -> env.step -> observation ids appended (chat.ChatFormatter)
      or agent_endpoint/            a harness environment's own agent asks for each turn over an
                                    OpenAI-compatible endpoint (one trajectory per segment of its history)
    -> on_done(trajectory)          into the trainer's buffer, the moment it finishes

``rollout_side.RolloutSide`` is the one object the trainer sees: it owns the engines, the pool, the
driver and the weight sync (``push_weights``, which chooses the servers of an update; the bytes move in
``megatron_sao/weights/``). Below it, by concern: ``engines/`` (the protocol and its backends) and
``colocate/`` (engine shards inside the trainer ranks). Nothing here imports the trainer, the run
config or Megatron (tests/unit/test_layering.py).
"""
