"""A plug-in written vllm-project/vime's way that imports a Megatron module of its that vime does not have (its
`model`; vime has only `cp_utils` there), for tests/unit/compat/test_plugin_compat.py."""

from vime.backends.megatron_utils.model import get_model_provider_func  # noqa: F401


async def generate(args, sample, sampling_params):
    return sample
