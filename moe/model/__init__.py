"""The MoE transformer: blocks and attention, routing and load balancing, the grouped experts,
expert growth and pruning, and the routing statistics training reports. Imports nothing of
training, checkpoints, data, SQL or Hugging Face."""
