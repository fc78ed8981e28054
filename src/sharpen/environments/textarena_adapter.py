"""An adapter that plays a `textarena` game as a text `Environment`: the policy is one player, and in a two-player
game a scripted opponent plays the other.

Each turn the policy sees what the game told its player since its last move (the game's own messages, the
opponent's moves as ``[Player 1] ...``), not the whole history again: the conversation already holds it. The policy's
turn goes to the game as it is (through the game's action wrappers, e.g. brackets added to a bare move); invalid
moves, the number of moves and the outcome are the game's rules. The reward comes when the game ends: the policy's
player's reward (single-player games score the result, often partial credit; two-player games give 1, 0 or -1).

The opponent: ``random`` picks, with the episode's rng, one of the bracketed moves in the latest game message that
lists any (TicTacToe's "Available Moves: '[0]', '[1]', ..."); any other opponent is ``module:function`` or
``path/file.py:function``, called as ``function(observation, rng) -> move`` with the text the game showed it.

textarena draws from Python's global ``random`` module (and seeds it at reset): each game here keeps its own state
of that generator and swaps it in around every call into the game, so games running side by side, and the rest of
the process, do not disturb each other. The seed is the example's ``metadata["env_seed"]`` (a group's samples face
the same game), else the episode's. Games that need NLTK word lists (Wordle, Hangman, ...) need those downloaded.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from sharpen.environments.base import EpisodeContext, StepResult
from sharpen.plugins import PluginLoadError, load_object
from sharpen.types import Example, Message

INSTALL_HINT = "pip install 'sharpen[agents]'"
_MOVE = re.compile(r"\[[^\[\]\n]{1,40}\]")
Opponent = Callable[[str, random.Random], str]


def import_textarena() -> Any:
    """``textarena``, or one error that names the extra to install."""
    try:
        import textarena
    except ImportError as error:
        raise PluginLoadError(
            f'environment.type = "textarena" needs the textarena package, which cannot be imported ({error}): '
            f"{INSTALL_HINT}"
        ) from error
    return textarena


def random_opponent(observation: str, rng: random.Random) -> str:
    """One of the bracketed moves of the last line of ``observation`` that lists any ("[pass]" if none)."""
    for line in reversed(observation.splitlines()):
        moves = _MOVE.findall(line)
        if moves:
            return rng.choice(moves)
    return "[pass]"


class TextArenaEnvironment:
    name = "textarena"
    version = "1"

    def __init__(
        self,
        env_id: str,
        *,
        num_players: int = 1,
        policy_player: int = 0,
        opponent: str = "random",
        instructions: str = "",
    ) -> None:
        if num_players not in (1, 2):
            raise ValueError(f"textarena: num_players must be 1 or 2, not {num_players}")
        if not 0 <= policy_player < num_players:
            raise ValueError(f"textarena: policy_player {policy_player} is not a player of a {num_players}-player game")
        self.env_id = env_id
        self.num_players = num_players
        self.policy_player = policy_player
        self.opponent: Opponent = (
            random_opponent if opponent == "random" else load_object(opponent, what="environment.opponent")
        )
        self.instructions = instructions
        self.game: Any = None
        self._board: Any = None  # the innermost game: its observations are per message, not wrapped into text
        self._random_state: Any = None
        self._rng = random.Random(0)

    @staticmethod
    def make_tasks(num_tasks: int, *, seed: int, env_id: str, instructions: str) -> list[Example]:
        """``num_tasks`` games of ``env_id``, each with its own seed."""
        prompt = (Message(role="system", content=instructions),) if instructions else ()
        return [
            Example(
                task_key=f"{env_id}/{index}",
                prompt=prompt,
                metadata={"source": "textarena", "env_seed": seed * 1_000_003 + index},
            )
            for index in range(num_tasks)
        ]

    async def reset(self, example: Example, ctx: EpisodeContext) -> list[Message]:
        textarena = import_textarena()
        seed = int(example.metadata.get("env_seed", ctx.seed))
        self._rng = random.Random(seed)
        self._random_state = random.Random(seed).getstate()
        with self._game_random():
            try:
                self.game = textarena.make(env_id=self.env_id)
            except ValueError as error:  # textarena's "not found in registry"
                raise ValueError(f"textarena: {error}") from None
            self._board = self.game
            while isinstance(self._board, textarena.Wrapper):
                self._board = self._board.env
            self.game.reset(num_players=self.num_players, seed=seed)
            self._play_opponent()
        system = [m for m in example.prompt if m.role == "system"]
        if not system and self.instructions:
            system = [Message(role="system", content=self.instructions)]
        return [*system, Message(role="user", content=self._observe())]

    async def step(self, action: str) -> StepResult:
        assert self.game is not None, "step() before reset()"
        with self._game_random():
            done, _ = self.game.step(action=action)
            if not done:
                self._play_opponent()
        state = self.game.state
        if not state.done:
            return StepResult(observation=[Message(role="user", content=self._observe())])
        reward = float((state.rewards or {}).get(self.policy_player, 0.0))
        reason = state.game_info.get(self.policy_player, {}).get("reason")
        return StepResult(reward=reward, terminated=True, info={"outcome": str(reason)} if reason else {})

    def _play_opponent(self) -> None:
        """The opponent's moves until it is the policy's turn or the game is over (called inside _game_random)."""
        state = self.game.state
        while not state.done and state.current_player_id != self.policy_player:
            _, messages = self._board.get_observation()
            self.game.step(action=self.opponent(self._text(messages), self._rng))

    def _observe(self) -> str:
        player, messages = self._board.get_observation()
        assert player == self.policy_player, f"the game waits for player {player}, not the policy's"
        # the policy's own moves are already in the conversation
        return self._text([m for m in messages if m[0] != self.policy_player])

    def _text(self, messages: list[Any]) -> str:
        names = self.game.state.role_mapping
        lines = [
            text.strip() if sender < 0 else f"[{names.get(sender, f'Player {sender}')}] {text.strip()}"
            for sender, text, _ in messages
        ]
        return "\n\n".join(line for line in lines if line)

    @contextlib.contextmanager
    def _game_random(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(outer)
