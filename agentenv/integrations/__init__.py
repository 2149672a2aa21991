"""agentenv inside other trainers: ``agentenv.integrations.trl`` (TRL's GRPOTrainer)."""
