"""Where prompts come from: the first stage of the data pipeline (prompts -> regeneration -> data ->
features). Nothing here imports those later stages, evaluation or training.

    corpora          local files, Hub datasets and the built-in prompt sources, read as records
    records          one raw record -> OpenAI-style chat messages, or the reason to skip it
    messages         a corpus's usable records as messages with their source labels, the others counted
    code_prompts     code-writing prompts from the documented functions of the installed Python code
    word_problems    generated grade-school word problems (the ``word-problems`` source)
    worked_math      generated math rewritten to ask for a worked solution (``:steps``)
    pack             ``python -m dflash_train.prompts.pack``: sources -> one JSONL of prompts
    eval_sets        the evaluation prompt sets, by name or from a file
    math_eval_set    the procedural math eval set
    decontaminate    word 13-gram overlap of training prompts with every eval set
"""
