"""A plug-in written vllm-project/vime's way that reads a setting vime does not have, for tests/unit/compat/test_plugin_compat.py."""


async def generate(args, sample, sampling_params):
    if args.keep_old_actor:  # vllm-project/vime's --keep-old-actor: no such setting in vime
        return sample
    return sample
