from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='nodeagent',
            name='job_isolation',
            field=models.CharField(blank=True, choices=[('separate-user', 'Jobs run as a separate unprivileged user'), ('shared-user', "Jobs share the agent's user")], help_text='Empty: the agent did not say (an agent older than this field)', max_length=16),
        ),
    ]
