"""Translation at this machine's scale: the gettext En-X corpus (training/gettext_corpus.py: which catalog entries
become pairs, the hash split, the length filter), train_seq2seq on it end to end, and the table of runs (mt_table)."""
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


def _mt_result(model="fwp", feature_map="elu", d_dot=0, update_rule="sum", seed=0, bleu=10.0, chrf=40.0,
               final_loss=2.5, train_seconds=120.0, test_exact_match=0.2, learning_rate=1e-3, corpus="abc"):
    """A train_seq2seq result file's fields that mt_table reads (test BLEU and chrF one above the valid ones)."""
    return {"args": {"model": {"model": model, "feature_map": feature_map, "d_dot": d_dot, "hidden_size": 128,
                               "num_attention_heads": 4, "update_rule": update_rule},
                     "training": {"seed": seed, "learning_rate": learning_rate}},
            "corpus": {"sha256": corpus}, "parameters": 1000, "train_loss": 3.0, "loss_curve": [5.0, final_loss],
            "train_seconds": train_seconds, "valid": {"bleu": bleu, "chrf": chrf, "exact_match": 0.1},
            "test": {"bleu": bleu + 1, "chrf": chrf + 1, "exact_match": test_exact_match}}


def test_table_orders_rows_as_the_paper_and_maps_d_dot_by_d_key(tmp_path):
    from training.mt_table import main as table_main

    def run(name, **settings):
        (tmp_path / f"{name}.json").write_text(json.dumps(_mt_result(**settings)))

    run("z_delta", feature_map="dpfp", d_dot=128, update_rule="delta", bleu=1.0)
    run("dpfp", feature_map="dpfp", d_dot=256, bleu=2.0)
    run("favor", feature_map="favor", d_dot=32, bleu=3.0)
    run("linear", bleu=4.0)
    run("softmax", model="softmax", bleu=5.0)
    (tmp_path / "other.json").write_text("[1, 2]")  # not a result file: ignored
    rows = table_main([str(tmp_path), "--output", str(tmp_path / "table.md")]).splitlines()[2:]
    assert (tmp_path / "table.md").read_text().splitlines()[2:] == rows
    assert [row.split(" | ")[0] for row in rows] == ["| Standard", "| Linear", "| Performer", "| DPFP",
                                                      "| DPFP + delta rule"]
    assert rows[0].endswith("| 26.6 / 27.7 |") and "| 5.0 | 6.0 |" in rows[0]  # softmax beside the paper's
    assert "| 32 (1) |" in rows[1] and rows[1].endswith("| 25.5 / 26.8 |")  # d_key 32: ELU's d_dot
    assert "| 32 (1) |" in rows[2] and rows[2].endswith("| 24.2 / 24.4 |")  # FAVOR+ at 1 d_key: paper's 64
    assert "| 256 (8) |" in rows[3] and rows[3].endswith("| 26.2 / 27.1 |")  # DPFP at 8 d_key: paper's 512
    assert rows[4].endswith("| - |") and "| 2.500 |" in rows[4] and "| 2.0 |" in rows[4]  # no paper row; minutes
    with pytest.raises(ValueError, match="no train_seq2seq result file"):
        table_main([str(tmp_path / "table.md")])


def test_table_averages_the_seeds_of_one_configuration_and_refuses_mixed_runs():
    from training.mt_table import render

    def dpfp(seed, bleu=10.0, **settings):  # one DPFP configuration; each seed's figures differ
        return _mt_result(feature_map="dpfp", d_dot=128, seed=seed, bleu=bleu, chrf=2 * bleu, final_loss=2.0 + seed,
                          train_seconds=60.0 * (seed + 1), test_exact_match=0.1 + seed / 10, **settings)

    (row,) = render([dpfp(1, bleu=12.0), dpfp(0, bleu=10.0)]).splitlines()[2:]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # seeds listed in order; every score the mean ± the sample standard deviation of the two runs
    assert cells[:5] == ["DPFP", "128 (4)", "0, 1", "1,000", "2.500 ± 0.707"]
    assert cells[5:11] == ["11.0 ± 1.4", "12.0 ± 1.4", "22.0 ± 2.8", "23.0 ± 2.8", "0.150 ± 0.071", "1.5 ± 0.7"]
    assert cells[11] == "26.2 / 26.9"
    with pytest.raises(ValueError, match="differ in more than the seed"):
        render([dpfp(0), dpfp(1, learning_rate=3e-4)])
    with pytest.raises(ValueError, match="differ in more than the seed"):
        render([dpfp(0), dpfp(1, corpus="other")])
    with pytest.raises(ValueError, match="two runs of one seed"):
        render([dpfp(0), dpfp(0, bleu=11.0)])
