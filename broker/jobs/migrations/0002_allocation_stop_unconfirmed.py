from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="allocation",
            name="stop_unconfirmed",
            field=models.BooleanField(default=False),
        ),
        migrations.AddIndex(
            model_name="allocation",
            index=models.Index(fields=["job", "stop_unconfirmed"], name="jobs_alloc_job_unconfirmed"),
        ),
    ]
