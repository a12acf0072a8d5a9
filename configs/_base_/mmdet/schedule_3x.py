# Shared fragment: the 3x COCO schedule of the Swin / XCiT / QuadTree dense protocols --
# mmdet's schedule_1x (500-iteration linear warm-up, ratio 1e-3) stretched to 36 epochs
# with steps at 27 and 33. A complete schedule base: list it in `_base_` *instead of*
# 'mmdet::_base_/schedules/schedule_1x.py'. A config that inherits a 1x config instead
# overrides `train_cfg` and `param_scheduler` with the same values itself (mmengine does not
# allow a key in two bases).
_base_ = 'mmdet::_base_/schedules/schedule_1x.py'

train_cfg = dict(max_epochs=36)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=36, by_epoch=True, milestones=[27, 33], gamma=0.1)
]
