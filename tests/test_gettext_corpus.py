"""The gettext En-X corpus (training/gettext_corpus.py): which catalog entries become pairs, the hash split, the
length filter, and train_seq2seq on it end to end (model and tokenizer saved, loaded back, translating)."""
import json
import struct
import zlib

import pytest
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import modeling_fwp  # noqa: F401  (registers the Auto classes)
from training.gettext_corpus import build_splits, read_catalog_pairs, split_of

HEADER = "Content-Type: text/plain; charset={}\n"


def write_mo(path, messages, charset="UTF-8", encoding="utf-8"):
    """A GNU .mo catalog (magic, sorted original and translation tables, strings) of `messages` {msgid: msgstr},
    its header declaring `charset`, its bytes in `encoding`."""
    entries = sorted({"": HEADER.format(charset), **messages}.items())
    ids = [k.encode(encoding) for k, _ in entries]
    strs = [v.encode(encoding) for _, v in entries]
    count, start = len(entries), 28
    data_start = start + 16 * count
    blob, id_table, str_table = b"", [], []
    for table, texts in ((id_table, ids), (str_table, strs)):
        for text in texts:
            table.append((len(text), data_start + len(blob)))
            blob += text + b"\0"
    head = struct.pack("<7I", 0x950412de, 0, count, start, start + 8 * count, 0, data_start)
    tables = b"".join(struct.pack("<2I", *e) for e in id_table + str_table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + tables + blob)


def test_catalog_entries_become_pairs(tmp_path):
    folder = tmp_path / "de" / "LC_MESSAGES"
    write_mo(folder / "b.mo", {"Open file": "Datei öffnen", "Close": "Schließen", "menu\x04Quit": "Beenden",
                               "OK": "OK", "two\nlines": "zwei\nZeilen", "a\tb": "a\tb2",
                               "one file\x00%d files": "eine Datei\x00%d Dateien", "Untranslated": ""})
    write_mo(folder / "a.mo", {"Close": "Zumachen", "Save": "Speichern"})
    write_mo(folder / "c.mo", {"Print": "Drücken"}, charset="ISO-8859-1", encoding="latin-1")
    write_mo(folder / "d.mo", {"Print all": "Alle drücken"}, encoding="latin-1")  # declares UTF-8, is not
    pairs, per_catalog = read_catalog_pairs(tmp_path, "de")
    # a.mo first (file-name order wins "Close"); b.mo: context dropped; identical, multi-line, tab, plural and
    # empty translations skipped; c.mo decoded by its declared charset; d.mo undecodable: skipped, counted -1
    assert pairs == [("Close", "Zumachen"), ("Save", "Speichern"), ("Open file", "Datei öffnen"), ("Quit", "Beenden"),
                     ("Print", "Drücken")]
    assert per_catalog == {"a": 2, "b": 2, "c": 1, "d": -1}
    with pytest.raises(ValueError, match="no gettext catalog"):
        read_catalog_pairs(tmp_path, "fr")


def synthetic_catalog(tmp_path, count=400):
    words = ["file", "folder", "disk", "user", "network", "printer", "window", "package"]
    german = ["Datei", "Ordner", "Datenträger", "Benutzer", "Netzwerk", "Drucker", "Fenster", "Paket"]
    messages = {}
    for i in range(count):
        a, b = i % 8, (i // 8) % 8
        german_text = f"{german[a]} {i} von {german[b]} kann nicht geöffnet werden"
        messages[f"Cannot open {words[a]} {i} of {words[b]}"] = german_text
    messages["Cannot open " + " ".join(words * 4)] = "Kann nicht " + " ".join(german * 4)  # too long below
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "x.mo", messages)
    return messages


def test_splits_are_disjoint_filtered_and_reproducible(tmp_path):
    messages = synthetic_catalog(tmp_path)
    corpus = build_splits(tmp_path, "de", vocab_size=300, max_tokens=30)
    manifest = corpus.manifest
    assert sum(manifest["sizes"].values()) + sum(manifest["dropped_too_long"].values()) == len(messages)
    assert sum(manifest["dropped_too_long"].values()) == 1 and manifest["sizes"]["valid"] > 0
    sources = {name: {s for s, _ in corpus.texts[name]} for name in ("train", "valid", "test")}
    assert not (sources["train"] & sources["valid"]) and not (sources["train"] & sources["test"])
    for name in sources:
        assert all(split_of(s, 20, 20) == name for s in sources[name])
        for (source_ids, target_ids), (source, target) in zip(corpus.pairs[name], corpus.texts[name]):
            assert max(len(source_ids), len(target_ids)) <= 30
            assert corpus.tokenizer.decode(target_ids) == target and messages[source] == target
    assert build_splits(tmp_path, "de", vocab_size=300, max_tokens=30).manifest["sha256"] == manifest["sha256"]
    assert split_of("x", 20, 20) == split_of("x", 20, 20) and zlib.crc32(b"x") % 1000 >= 40  # "x" is training text
    with pytest.raises(ValueError, match="max_tokens"):
        build_splits(tmp_path, "de", vocab_size=300, max_tokens=0)


def test_training_script_on_the_corpus_saves_a_loadable_translator(tmp_path):
    pytest.importorskip("sacrebleu")
    from training.train_seq2seq import GettextTask, TaskArguments, main, score

    synthetic_catalog(tmp_path / "locale")
    results = main([
        "--task", "gettext", "--locale_dir", str(tmp_path / "locale"), "--vocab_size", "300", "--max_tokens", "30",
        "--output_dir", str(tmp_path / "run"), "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--num_beams", "2", "--report_to", "none", "--use_cpu", "--hidden_size", "16", "--intermediate_size", "16",
        "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1", "--eval_examples", "3",
    ])
    assert results["corpus"]["sizes"]["train"] > 300 and len(results["loss_curve"]) == 2
    assert json.loads((tmp_path / "run" / "results.json").read_text())["run"]["load_average_start"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final").eval()
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2 and len(tokenizer) == 300
    # the saved pair is the trained one: scoring it again gives the run's validation translations and scores
    task = GettextTask(TaskArguments(locale_dir=str(tmp_path / "locale"), vocab_size=300, max_tokens=30,
                                     eval_examples=3))
    again = score(model, task, task.split("valid"), num_beams=2, batch_size=100)
    assert again == results["valid"]
    batch = tokenizer(["Cannot open file 3 of disk"], return_tensors="pt", add_special_tokens=False)
    assert batch["input_ids"].tolist() == [task.corpus.tokenizer.encode("Cannot open file 3 of disk").ids]
    out = model.generate(**batch, num_beams=2, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and 1 < out.shape[1] <= 6
