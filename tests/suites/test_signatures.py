"""Signatures and defaults shown in prose agree with the code (`inspect.signature`).

Where they are read: README.md and docs/*.rst (inline code, outside code blocks, which run in
test_readme.py and test_docs.py), and every docstring of the package, which `help()` shows.
What counts as a shown claim:

- a signature: inline code `name(...)` whose argument list has a bare `*`. Its names must be
  the real parameters in order (only `**kwargs`, or whatever follows a final `...`, may be
  left out), the `*` where the keyword-only ones start, and each shown default the real one;
- a default in a sentence that says "default": inline code `name=value`, attributed to the
  nearest callable named before it in the sentence that has such a parameter, else to the
  docstring's owner or the page section's callable;
  likewise `Callable(name=value)` (the default ...) and `name` defaults to value;
- a docs list item `- **name** (value; ...)` (several names take as many comma-separated
  values; `v for ``f``` names the callable), for the callables of the paragraph before;
- a code line calling a public callable with a comment that says "default" (README, docs,
  docstrings, examples), and a comment "`kfac_jax.X`'s defaults (name value, ...)".

`help(kfac_jax)` also shows each public callable's own signature; it must be the real one (a
wrapper that hides it would show `(*args, **kwargs)`).
"""

import ast
import dataclasses
import glob
import importlib
import inspect
import os
import pkgutil
import pydoc
import re

import jax.numpy as jnp
from flax.training import train_state as flax_train_state

import kfac_jax
import kfac_jax.flax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny():
  def loss_fn(params, batch):
    logits = batch["x"] @ params["w"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return jnp.mean(logits**2)

  batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4,), jnp.int32)}
  return loss_fn, batch


# Callables named in prose, by the name they are shown with.
_PUBLIC = {n: getattr(kfac_jax, n) for n in kfac_jax.__all__ if callable(getattr(kfac_jax, n))}
_PUBLIC.update({f"kfac_jax.{n}": f for n, f in list(_PUBLIC.items())})
_PUBLIC["kfac_jax.flax.TrainState"] = kfac_jax.flax.TrainState
_PUBLIC["flax.training.train_state.TrainState"] = flax_train_state.TrainState  # What we extend.


def _resolve(name, owner):
  """The object `name` refers to (None if it is not one of ours): `update` / `tx.update` is the
  update of the transform `owner` builds."""
  if name in ("update", "tx.update"):
    front = getattr(owner, "__name__", owner)
    if front in ("scale_by_kfac", "kfac"):
      loss_fn, batch = _tiny()
      kw = {"learning_rate": 0.1} if front == "kfac" else {}
      return getattr(kfac_jax, front)(loss_fn, batch, **kw).update
    if front == "as_optax":
      loss_fn, batch = _tiny()
      return kfac_jax.Optimizer(loss_fn, batch).as_optax().update
    return None
  if name in _PUBLIC:
    return _PUBLIC[name]
  head, _, attr = name.rpartition(".")
  base = _PUBLIC.get(head)
  if base is None and head == "TrainState":
    base = kfac_jax.flax.TrainState
  return getattr(base, attr, None) if base is not None else None


def _split_args(text):
  """Top-level comma-separated items of an argument list."""
  items, depth, cur, quote = [], 0, "", None
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      items.append(cur.strip())
      cur = ""
      continue
    cur += ch
  if cur.strip():
    items.append(cur.strip())
  return items


_MISSING = object()
# Every claim checked, as (where, name, callable's qualname): the tests assert that the known
# claims are among them, so a parser that finds nothing fails.
CHECKED = []


def _literal(text):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return _MISSING


def _params(obj):
  sig = inspect.signature(obj)
  return [p for p in sig.parameters.values() if p.name != "self"]


def _default(p):
  d = p.default
  if isinstance(d, dataclasses.Field):
    return d.default
  return d


def check_signature(shown, obj, where):
  """Problems of a shown argument list against `obj`'s real signature."""
  items = _split_args(shown)
  real = _params(obj)
  names = [p.name for p in real]
  problems, pos, keyword_only = [], -1, False
  truncated = bool(items) and items[-1] in ("...", "…")
  for item in items:
    if item in ("...", "…"):
      continue
    if item == "*":
      keyword_only = True
      continue
    name, eq, value = item.partition("=")
    name = name.strip().lstrip("*")
    if name not in names:
      problems.append(f"{where}: `{name}` is not a parameter of {obj.__qualname__}{names}")
      continue
    i = names.index(name)
    if i < pos:
      problems.append(f"{where}: `{name}` is shown out of order (real order {names})")
    pos = i
    p = real[i]
    if keyword_only != (p.kind is p.KEYWORD_ONLY) and p.kind not in (p.VAR_KEYWORD,):
      problems.append(f"{where}: `{name}` is {p.kind.description} but shown otherwise")
    if eq:
      want = _literal(value.strip())
      if want is not _MISSING and (p.default is p.empty or want != _default(p)):
        problems.append(f"{where}: `{name}={value.strip()}`, but the default is {p.default!r}")
  shown_names = {i.partition("=")[0].strip().lstrip("*") for i in items}
  for p in real:
    if p.name in shown_names or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
      continue
    if not truncated or names.index(p.name) < pos:
      problems.append(f"{where}: `{p.name}` of {obj.__qualname__} is not shown")
  return problems


# -- the texts -------------------------------------------------------------------------------


def _docstrings():
  """(where, owner, text) for every docstring in the package."""
  seen, out = set(), []
  names = ["kfac_jax"] + [
    m.name for m in pkgutil.walk_packages(kfac_jax.__path__, "kfac_jax.") if "test" not in m.name
  ]
  for modname in names:
    mod = importlib.import_module(modname)
    out.append((modname, None, inspect.getdoc(mod) or ""))
    for _, obj in inspect.getmembers(mod):
      if getattr(obj, "__module__", None) != modname or id(obj) in seen:
        continue
      if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue
      seen.add(id(obj))
      out.append((f"{modname}.{obj.__qualname__}", obj, inspect.getdoc(obj) or ""))
      if inspect.isclass(obj):
        for mname, m in vars(obj).items():
          m = getattr(m, "__func__", m)
          if inspect.isfunction(m) and m.__doc__:
            out.append((f"{modname}.{obj.__qualname__}.{mname}", m, inspect.getdoc(m)))
  return out


def _strip_rst_code(text):
  """The page without its code blocks and directives' bodies (`.. code-block::`, tables kept)."""
  out, skip = [], None
  for line in text.splitlines():
    indent = len(line) - len(line.lstrip())
    if skip is not None:
      if line.strip() and indent <= skip:
        skip = None
      else:
        out.append("")
        continue
    if line.strip().startswith(".. code-block::") or line.rstrip().endswith("::"):
      skip = indent
      out.append("")
      continue
    out.append(line)
  return "\n".join(out)


def _strip_md_code(text):
  return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


_SPAN = {"rst": re.compile(r"``(.+?)``", re.S), "md": re.compile(r"(?<!`)`([^`]+?)`(?!`)", re.S)}


def _sections(text, kind):
  """(section owner or None, section text) of a page; the owner is the first callable named
  in inline code in the section's heading."""
  if kind == "md":
    return [(None, text)]
  lines = text.splitlines()
  bounds = [0] + [
    i - 1
    for i in range(1, len(lines))
    if re.fullmatch(r"([=\-~^])\1{3,}", lines[i].strip()) and lines[i - 1].strip()
  ]
  out = []
  for a, b in zip(bounds, bounds[1:] + [len(lines)]):
    head = lines[a] if a else ""
    owner = next(
      (
        _resolve(n, None)
        for n in _SPAN["rst"].findall(head)
        if _resolve(n.strip(), None) is not None
      ),
      None,
    )
    out.append((owner, "\n".join(lines[a:b])))
  return out


def _sentences(text):
  """Sentences, table cells, list items and the entries of a docstring's Args section."""
  return re.split(r"(?<=[.;])\s+(?=[A-Z`(])|\n\s*\n|\n\s*(?:\* )?- |\n\s*\w+(?:, \w+)*: ", text)


def _named(sentence, pattern):
  """Callables named (in inline code) in a sentence, in order."""
  out = []
  for span in pattern.findall(sentence):
    name = re.sub(r"\(.*$", "", span.strip(), flags=re.S).removesuffix("'s").strip()
    obj = _resolve(name, None)
    if obj is not None:
      out.append(obj)
  return out


def _has_param(obj, name):
  try:
    return any(p.name == name for p in _params(obj))
  except (TypeError, ValueError):
    return False


def _param(obj, name):
  return next(p for p in _params(obj) if p.name == name)


def check_text(text, where, owner, kind):
  """Problems of one text: its signatures and its default claims."""
  pattern = _SPAN[kind]
  problems = []
  for section_owner, section in _sections(text, kind):
    owner_here = owner if owner is not None else section_owner
    for span in pattern.findall(section):
      m = re.fullmatch(r"([A-Za-z_][\w.]*)\((.*)\)", span.strip(), re.S)
      if not m or not re.search(r"(^|,)\s*\*\s*(,|$)", m.group(2)):
        continue
      obj = _resolve(m.group(1), owner_here)
      if obj is None:
        if m.group(1).startswith(("kfac_jax", "tx.", "update")):
          problems.append(f"{where}: cannot resolve the shown signature `{span}`")
        continue
      problems += check_signature(m.group(2), obj, f"{where}: `{span.strip()}`")
      CHECKED.append((where, "signature", obj.__qualname__))
    for sentence in _sentences(section):
      if "default" not in sentence:
        continue
      named = _named(sentence, pattern)
      # `Callable(name=value)` (the default ...) and `name` defaults to value.
      q = "``" if kind == "rst" else "`"
      forms = [
        (rf"{q}([\w.]+)\((\w+)=([^)]+)\){q} \(the default", lambda m: [_resolve(m[1], None)]),
        (rf"{q}(\w+){q} defaults to ([^\s,;]+?)[.,;]?(?:\s|$)", lambda m: named + [owner_here]),
      ]
      for regex, fronts_of in forms:
        for m in re.finditer(regex, sentence):
          name, value = (m[2], m[3]) if m.re.groups == 3 else (m[1], m[2])
          fronts = [o for o in fronts_of(m) if o is not None and _has_param(o, name)]
          if _literal(value) is _MISSING:
            continue
          if not fronts:
            problems.append(f"{where}: default of `{name}` of no callable named: {sentence!r}")
            continue
          CHECKED.append((where, name, fronts[0].__qualname__))
          if _default(_param(fronts[0], name)) != _literal(value):
            problems.append(
              f"{where}: {m[0]!r}, but {fronts[0].__qualname__}'s default is "
              f"{_default(_param(fronts[0], name))!r}"
            )
      for m in pattern.finditer(sentence):
        claim = re.fullmatch(r"(\w+)\s*=\s*(.+)", m.group(1).strip(), re.S)
        if not claim:
          continue
        name, value = claim.groups()
        want = _literal(value)
        if want is _MISSING:
          continue
        before = [o for o in _named(sentence[: m.start()], pattern)][::-1]
        rest = [o for o in named if o not in before]
        candidates = before + rest + [owner_here]
        obj = next((o for o in candidates if o is not None and _has_param(o, name)), None)
        if obj is None:
          problems.append(f"{where}: default `{name}={value}` of no callable named: {sentence!r}")
          continue
        got = _default(_param(obj, name))
        CHECKED.append((where, name, obj.__qualname__))
        if got != want:
          problems.append(
            f"{where}: `{name}={value}` shown as {obj.__qualname__}'s default, which is {got!r}"
          )
  return problems


def check_lists(text, where):
  """Problems of a page's lists `- **name** (default; ...)`, for the callables of the
  paragraph before each list."""
  problems = []
  paragraphs = re.split(r"\n\s*\n", text)
  for prev, para in zip([""] + paragraphs, paragraphs):
    if not para.lstrip().startswith("- **"):
      continue
    callables = _named(prev, _SPAN["rst"])
    for item in re.split(r"\n(?=- )", para):
      item = re.sub(r"\s+", " ", item)
      group = re.compile(r"((?:\*\*\w+\*\*,? )+)\(([^)]*)\),? ?")
      m, pos = None, 2
      while item.startswith("- **") and (m := group.match(item, pos)):
        problems += _check_list_group(m.group(1), m.group(2).split(";")[0], callables, where)
        pos = m.end()
  return problems


def _check_list_group(group, shown, callables, where):
  """One `**a**, **b** (va, vb)` of a list item."""
  problems, pairs = [], []
  names = re.findall(r"\*\*(\w+)\*\*", group)
  values = [v.strip() for v in shown.split(",")]
  if len(names) == 1 and len(values) > 1 and all(" for " in v for v in values):
    for v in values:
      value, _, front = v.partition(" for ")
      pairs.append((names[0], value, [_resolve(front.strip("` "), None)]))
  elif len(values) == len(names):
    pairs = [(n, v, callables) for n, v in zip(names, values)]
  for name, value, fronts in pairs:
    want = _literal(value.strip("`"))
    if want is _MISSING:
      continue
    obj = next((o for o in fronts if o is not None and _has_param(o, name)), None)
    if obj is None:
      problems.append(f"{where}: `{name}` ({value}) is a parameter of none of {fronts}")
      continue
    got = _default(_param(obj, name))
    CHECKED.append((where, name, obj.__qualname__))
    if got != want:
      problems.append(f"{where}: **{name}** ({value}), but {obj.__qualname__}'s is {got!r}")
  return problems


def check_code_comments(text, where):
  """Problems of code lines that call a public callable and say in a comment that they show
  its defaults (`kfac_jax.kfac(loss_fn, batch, learning_rate=1.0)  # the defaults`): each
  `name=value` given must be the default, where the parameter has one other than None
  (None marks a required value such as `kfac`'s learning rate)."""
  problems = []
  for line in text.splitlines():
    m = re.search(r"(kfac_jax\.[\w.]+)\((.*)\)\s*#.*\bdefaults?\b", line)
    if not m or (obj := _resolve(m.group(1), None)) is None:
      continue
    for item in _split_args(m.group(2)):
      name, eq, value = item.partition("=")
      if not eq or not _has_param(obj, name.strip()):
        continue
      p = _param(obj, name.strip())
      want = _literal(value.strip())
      if p.default in (None, p.empty) or want is _MISSING:
        continue
      CHECKED.append((where, name.strip(), obj.__qualname__))
      if want != _default(p):
        problems.append(f"{where}: {line.strip()!r}: {obj.__qualname__}'s default is {p.default!r}")
  # Prose in comments: "`kfac_jax.kfac`'s defaults (momentum 0.7, max_norm 0.3, ...)".
  for m in re.finditer(r"`(kfac_jax\.\w+)`'s defaults \(([^)]*)\)", text):
    obj = _resolve(m.group(1), None)
    for name, value in re.findall(r"(\w+) ([-+.\w]+)", re.sub(r"\s*#\s*", " ", m.group(2))):
      if obj is None or not _has_param(obj, name) or _literal(value) is _MISSING:
        continue
      CHECKED.append((where, name, obj.__qualname__))
      if _literal(value) != _default(_param(obj, name)):
        problems.append(f"{where}: {name} {value} shown as {obj.__qualname__}'s default")
  return problems


def _pages():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    out = [("README.md", "md", _strip_md_code(f.read()))]
  for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
    if name.endswith(".rst"):
      with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        out.append((f"docs/{name}", "rst", _strip_rst_code(f.read())))
  return out


# -- the tests -------------------------------------------------------------------------------


def test_signatures_and_defaults_in_the_docs():
  problems = []
  CHECKED.clear()
  for where, kind, text in _pages():
    problems += check_text(text, where, None, kind)
    if kind == "rst":
      problems += check_lists(text, where)
  for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.rst")))]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      problems += check_code_comments(f.read(), os.path.relpath(path, ROOT))
  for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py"))):
    with open(path, encoding="utf-8") as f:
      problems += check_code_comments(f.read(), os.path.relpath(path, ROOT))
  assert not problems, "\n".join(problems)
  for claim in [
    ("examples/autoencoder.py", "max_norm", "kfac"),
    ("docs/entry_points.rst", "signature", "kfac"),
    ("docs/entry_points.rst", "signature", "scale_by_kfac"),
    ("docs/entry_points.rst", "signature", "value_and_grad"),
    ("docs/entry_points.rst", "signature", "transformation.<locals>.update_fn"),
    ("docs/entry_points.rst", "momentum", "kfac"),
    ("docs/hyperparameters.rst", "max_norm", "kfac"),
    ("docs/hyperparameters.rst", "statistics_fraction", "Config"),
    ("docs/hyperparameters.rst", "curvature_every", "scale_by_kfac"),
    ("docs/hyperparameters.rst", "max_damping", "Config"),
  ]:
    assert claim in CHECKED, (claim, CHECKED)


def test_signatures_and_defaults_in_docstrings():
  problems = []
  CHECKED.clear()
  for where, owner, text in _docstrings():
    problems += check_text(text, where, owner, "md") + check_code_comments(text, where)
  assert not problems, "\n".join(problems)
  for claim in [
    ("kfac_jax._transform.scale_by_kfac", "signature", "transformation.<locals>.update_fn"),
    (
      "kfac_jax._optimizer.Optimizer.as_optax",
      "signature",
      "Optimizer.as_optax.<locals>.update_fn",
    ),
    ("kfac_jax.flax", "signature", "TrainState.apply_gradients"),
    (
      "kfac_jax._tags.register_normal_predictive_distribution",
      "var",
      "register_normal_predictive_distribution",
    ),
  ]:
    assert claim in CHECKED, (claim, sorted(set(CHECKED)))


def test_help_shows_the_real_signatures():
  """`help(kfac_jax)` shows each public callable with its real signature (wrappers keep it)."""
  text = pydoc.render_doc(kfac_jax, renderer=pydoc.plaintext)
  for name in kfac_jax.__all__:
    obj = getattr(kfac_jax, name)
    if not inspect.isfunction(obj):
      continue
    shown = f"{obj.__name__}{inspect.signature(obj)}"  # An alias shows `alias = name(...)`.
    assert shown in re.sub(r"\s+", " ", text), name
    assert "*args, **kwargs" not in str(inspect.signature(obj)), name


def test_the_checks_find_drift():
  """The checks above are not vacuous: drifted signatures and defaults are reported."""
  sig = kfac_jax.scale_by_kfac
  assert (
    check_signature(
      "loss_fn, example_batch, *, damping=0.1, ema_decay=0.95, inverse_every=5, curvature_every=1,"
      " registration, axis_name, config",
      sig,
      "x",
    )
    == []
  )
  bad = {
    "damping=1e-3": "the default is 0.1",
    "dampnig=0.1": "`dampnig` is not a parameter",
    "ema_decay=0.95, damping=0.1": "out of order",
  }
  for shown, message in bad.items():
    problems = check_signature(f"loss_fn, example_batch, *, {shown}, ...", sig, "x")
    assert any(message in p for p in problems), (shown, problems)
  # A keyword-only parameter shown before `*`, and one left out.
  assert any("keyword-only" in p for p in check_signature("loss_fn, damping, ...", sig, "x"))
  assert any(
    "`config`" in p for p in check_signature("loss_fn, example_batch, *, damping", sig, "x")
  )
  text = "``kfac_jax.kfac``'s defaults are ``momentum=0.7`` and ``damping=1e-3``."
  (problem,) = check_text(text, "x", None, "rst")
  assert "`damping=1e-3` shown as kfac's default, which is 0.1" in problem
  # `help(kfac_jax)` text: the package docstring is checked like every other docstring.
  (problem,) = check_text("The defaults: `learning_rate=0.1`.", "x", kfac_jax.kfac, "md")
  assert "learning_rate" in problem
  line = "tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1, damping=1e-3)  # the defaults"
  (problem,) = check_code_comments(line, "x")
  assert "kfac's default is 0.1" in problem
  (problem,) = check_code_comments("# `kfac_jax.kfac`'s defaults (momentum 0.9)", "x")
  assert "momentum 0.9" in problem
  lists = "The arguments of ``kfac``:\n\n- **ema_decay** (0.9): the average.\n"
  assert check_lists(lists, "x") == ["x: **ema_decay** (0.9), but kfac's is 0.95"]
