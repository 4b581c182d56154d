from dflash_train.inference.greedy import GenerationResult, accepted_prefix_length, generate_greedy

__all__ = ["GenerationResult", "accepted_prefix_length", "generate_greedy"]
