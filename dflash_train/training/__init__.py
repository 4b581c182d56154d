from dflash_train.training.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
