"""The measurement scripts (each runnable as `python experiments/<name>.py`), and what they share."""
import csv
import os


def write_rows(path, rows):
    """Write a script's result rows (dicts with the first one's keys) to a new CSV, header first."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def append_row(path, row, fieldnames=None):
    """Append one result row to a CSV (the header first when the file is new or empty), so that a
    sweep cut short keeps every row it measured."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fieldnames or row))
        if new:
            writer.writeheader()
        writer.writerow(row)
