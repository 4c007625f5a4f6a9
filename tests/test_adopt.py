

def test_lightning_ckpt_of_custom_loss_folder_reloads_with_its_labels(folders: dict[str, Path], tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "custom-loss")
    batches = _batches(case, 2)
    module = ORTLightningModule(folders["custom-loss"], lr=LR, lr_scheduler="constant", labels=["my_target"])
    data = TensorDataset(*(torch.cat(column) for column in zip(*batches, strict=True)))
    trainer = pl.Trainer(max_steps=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
                         default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    (saved,) = tmp_path.rglob("*.ckpt")
    reloaded = ORTLightningModule.load_from_checkpoint(saved)
    assert [spec.name for spec in reloaded.artifacts.manifest.labels] == ["my_target"]
    for (name, tensor), (_, original) in zip(reloaded.named_parameters(), module.named_parameters(), strict=True):
        torch.testing.assert_close(tensor, original, rtol=0, atol=0, msg=name)
