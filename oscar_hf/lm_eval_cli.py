"""``oscar-lm-eval``: lm-eval's command line with the "hf-oscar" model registered.

lm-eval 0.4.13 does not discover third-party models (it reads no entry points), so the plain
``lm_eval`` command cannot see "hf-oscar". This command takes exactly lm_eval's arguments::

    oscar-lm-eval run --model hf-oscar --model_args pretrained=MODEL,rotations=BUNDLE --tasks gsm8k
    accelerate launch -m oscar_hf.lm_eval_cli run --model hf-oscar ...   # data parallel
"""

import oscar_hf.lm_eval_model  # noqa: F401  (registers "hf-oscar"; says how to install lm-eval if it is missing)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
