"""`videosparse.processors.forward_args.forward_arg`: an argument by keyword first, else at its position, else None."""

from videosparse.processors.forward_args import forward_arg


def test_an_argument_given_by_keyword_wins_over_a_positional_one_at_its_index():
    x, other = object(), object()
    assert forward_arg((other,), {"hidden_states": x}, "hidden_states", 0) is x
    assert forward_arg((other, x), {}, "encoder_hidden_states", 1) is x


def test_an_argument_past_the_positional_ones_is_none():
    x = object()
    assert forward_arg((x,), {}, "encoder_hidden_states", 1) is None
    assert forward_arg((), {}, "hidden_states", 0) is None
    assert forward_arg((x, x), {}, "timestep", 5) is None


def test_a_forward_without_timestep_reads_none_when_called_positionally():
    """Cosmos 3's forward takes no `timestep`: its positional arguments are moved to their names before the context
    hook reads the step's timestep at the fallback position 1, so `text_indexes` (its second parameter) is never
    taken for a timestep."""
    from diffusers import Cosmos3OmniTransformer

    from videosparse.processors.forward_args import args_by_name

    text_indexes = object()
    args, kwargs = args_by_name(Cosmos3OmniTransformer.forward, ("ids", text_indexes, "positions", 3, 10), {})
    assert args == () and kwargs["text_indexes"] is text_indexes
    assert forward_arg(args, kwargs, "timestep", 1) is None
