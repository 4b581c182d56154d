from dflash_train.models.cache import DraftKVCache
from dflash_train.models.config import DFlashConfig
from dflash_train.models.draft import DFlashDraftModel

__all__ = ["DFlashConfig", "DFlashDraftModel", "DraftKVCache"]
