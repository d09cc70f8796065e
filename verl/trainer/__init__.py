"""PPO / GRPO training: the dataflow (ppo_flow), the loop (ppo_trainer) and the launcher (main_ppo)."""
